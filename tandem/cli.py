"""The ``tandem`` command.

    tandem serve     the whole cluster on this machine (redis-server unless
                     --redis-url, the workers, the gateway; on one device one
                     worker runs both pools, --pools separate keeps two)
    tandem gateway   the HTTP gateway alone
    tandem prefill   one prefill worker
    tandem decode    one decode worker
    tandem colocated one worker running both pools on its device (mixed steps)
    tandem demo-model PATH   write the tiny random Llama that --model demo serves
    tandem admin ...         the gRPC admin API: workers, policies, drain, cancel
    tandem status            the cluster's workers, load and restarts at a glance
    tandem bench serve ...   streaming load client against an OpenAI-compatible URL
    tandem bench throughput  offline: N requests sent at once against a running cluster
    tandem bench multi-turn  conversations, each turn the whole conversation so far (prefix reuse)
    tandem bench engine ...  engine workloads vs ceilings and HF anchors (GPU)
    tandem bench grammar     structured-output engines: setup and per-step mask time
"""

from __future__ import annotations

import argparse
import sys

from tandem.cluster import settings as settings_mod
from tandem.cluster.checkpoint import CheckpointError
from tandem.models import resolve_model


def _config(args: argparse.Namespace) -> int:
    """``tandem config [flags]``: the settings these flags and this environment give."""
    settings = settings_mod.Settings.from_args(args)
    sources = settings_mod.Settings.sources(args)
    implied = [name for name in ("max_seq_len", "max_input_len") if getattr(settings, name) is None]
    try:
        settings.model = resolve_model(settings.model)
        settings.resolve()
        sources.update({name: "model" for name in implied})
    except (settings_mod.SettingsError, CheckpointError) as exc:
        print(f"# not resolved against the model: {exc}")
    print(settings_mod.describe(settings, sources))
    from tandem.kernels.switches import describe as describe_switches  # torch-free

    print(describe_switches())
    print("live policies (Redis, tandem admin set-policy): capacity_scheduler_policy, context_chunking_policy; "
          "seeded by the flags above")
    return 0


def _service(role: str, args: argparse.Namespace) -> int:
    from tandem.cluster.process import configure_logging, stop_on_signals

    settings = settings_mod.Settings.from_args(args)
    settings.model = resolve_model(settings.model)
    settings.resolve()
    configure_logging(settings.log_level, role, settings.log_format)
    if role == "gateway":
        from tandem.gateway.server import main as run_gateway

        run_gateway(settings)
        return 0
    if settings.cpu_threads:
        import torch  # a worker's own threads: tandem serve's workers share the machine's cores

        torch.set_num_threads(settings.cpu_threads)
    stop = stop_on_signals()
    if role == "prefill":
        from tandem.prefill.worker import main as run
    elif role == "colocated":
        from tandem.colocated import main as run
    else:
        from tandem.decode.worker import main as run
    run(settings, stop)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the whole cluster on this machine")
    settings_mod.add_arguments(serve)
    settings_mod.add_arguments(sub.add_parser(
        "config", help="print every setting's effective value and where it came from (flag, variable, "
                       "default, model), the kernel tuning switches, and the live policies' home"))
    for role in ("gateway", "prefill", "decode", "colocated"):
        settings_mod.add_arguments(sub.add_parser(role, help=f"run one {role} service"))
    demo = sub.add_parser("demo-model", help="write the tiny random demo Llama to PATH")
    demo.add_argument("path")
    from tandem.gateway import admin_client

    admin_client.add_arguments(sub.add_parser("admin", help="manage a running cluster (gRPC admin API)"))
    from tandem.gateway import status

    status.add_arguments(sub.add_parser("status", help="the cluster's workers, load and restarts (admin API)"))
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tandem.bench import serve as bench_serve

    bench_serve.add_arguments(bench_sub.add_parser("serve", help="streaming load client (like vllm bench serve)"))
    from tandem.bench import throughput as bench_throughput

    bench_throughput.add_arguments(bench_sub.add_parser(
        "throughput", help="offline: N requests sent at once (like trtllm-bench / vllm bench throughput)"))
    from tandem.bench import multi_turn as bench_multi_turn

    bench_multi_turn.add_arguments(bench_sub.add_parser(
        "multi-turn", help="conversations whose every turn sends the whole conversation so far"))
    from tandem.bench import grammar as bench_grammar

    bench_grammar.add_arguments(bench_sub.add_parser("grammar", help="structured-output engines: setup and mask time"))
    from tandem.bench import engine_args

    engine_args.add_arguments(
        bench_sub.add_parser("engine", help="engine vs hardware ceilings and HF anchors (needs a GPU)")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from tandem.launcher import serve

            return serve(args)
        if args.command == "config":
            return _config(args)
        if args.command == "demo-model":
            from tandem.engine.demo_model import make_tiny_checkpoint

            print(make_tiny_checkpoint(args.path))
            return 0
        if args.command == "status":
            from tandem.gateway import status

            return status.main(args)
        if args.command == "admin":
            from tandem.gateway import admin_client

            return admin_client.main(args)
        if args.command == "bench" and args.bench_command == "grammar":
            from tandem.bench import grammar as bench_grammar

            return bench_grammar.main(args)
        if args.command == "bench" and args.bench_command == "engine":
            from tandem.bench import engine as bench_engine

            return bench_engine.main(args)
        if args.command == "bench" and args.bench_command == "multi-turn":
            from tandem.bench import multi_turn as bench_multi_turn

            return bench_multi_turn.main(args)
        if args.command == "bench" and args.bench_command == "throughput":
            from tandem.bench import throughput as bench_throughput

            return bench_throughput.main(args)
        if args.command == "bench":
            from tandem.bench import serve as bench_serve

            return bench_serve.main(args)
        return _service(args.command, args)
    except (settings_mod.SettingsError, CheckpointError) as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
