"""A decode step of a model split over ranks against the same step on one rank.

    python -m tandem.bench.tp_step --checkpoint /tmp/tandem-bench-llama3-8b --tp 2 --batches 1,8,64 \
        --out tp_step.json

The step of one rank runs as a worker runs it (CUDA graphs on a GPU); the split model's as a
worker of ``--tp`` ranks runs it (``engine.tensor_parallel``: each rank in its own process on
its own device, the leader sending each step to its followers, the partial sums all-reduced
over NCCL; gloo on the CPU). Every row of a batch attends to ``--context`` tokens of KV. Rows:
``{workload, tp, batch, ms, ratio}``, ``ratio`` = the split step over the one-rank step.
``--checkpoint`` of a missing directory with ``--model-shape``: a random-weight checkpoint of
that shape is written there first (``tandem.bench.cluster_mixed``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import time

import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.step_tokens import TokenFeed


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def _runner(path: str, device: torch.device, tp=None, num_blocks: int = 0, block_size: int = 16):
    from tandem.engine.loader import load_model
    from tandem.engine.runner import ModelRunner

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, config = load_model(path, dtype=dtype, device=device, tp_rank=0 if tp is None else tp.rank,
                               tp_size=1 if tp is None else tp.size)
    return ModelRunner.from_model(model, config, num_blocks, block_size, tp=tp)


def _steps_ms(runner, batch: int, context: int, steps: int) -> float:
    """Mean ms of decode steps of ``batch`` rows fed on the device, each at ``context`` tokens."""
    per_row = -(-(context + steps + 1) // runner.block_size)
    chunks = [SeqChunk([5], context, list(range(r * per_row, (r + 1) * per_row))) for r in range(batch)]
    tokens = torch.full((batch,), 5, dtype=torch.int64, device=runner.device)
    feed = TokenFeed(tokens, list(range(batch)))

    def step():
        return runner.forward(chunks, feed).argmax(-1)

    for _ in range(3):
        step()
    _sync(runner.device)
    start = time.perf_counter()
    for _ in range(steps):
        tokens = step()
    _sync(runner.device)
    return (time.perf_counter() - start) * 1000 / steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, size: int, init_method: str, args: dict, out: str | None) -> None:
    from tandem.engine.tensor_parallel import TPGroup

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // size))
    device = _device(rank)
    group = TPGroup(rank, size, init_method, device)
    runner = _runner(args["checkpoint"], device, group, args["num_blocks"], args["block_size"])
    if not group.is_leader:
        runner.follow()
        group.close()
        return
    rows = {b: _steps_ms(runner, b, args["context"], args["steps"]) for b in args["batches"]}
    with open(out, "w") as f:
        json.dump(rows, f)
    group.stop()
    group.close()


def split_steps(args: dict, size: int) -> dict[int, float]:
    """batch -> ms of the split model's decode step, ``size`` ranks in processes of their own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    out = os.path.join(args["out_dir"], f"tp{size}_steps.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, size, init, args, out if r == 0 else None)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if procs[0].exitcode != 0:
        raise RuntimeError(f"the split run failed: exit codes {[p.exitcode for p in procs]}")
    with open(out) as f:
        return {int(b): ms for b, ms in json.load(f).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--model-shape", default=None, help="write a random checkpoint of this shape if missing")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default="tp_step.json")
    a = parser.parse_args(argv)
    if a.model_shape and not os.path.isfile(os.path.join(a.checkpoint, "config.json")):
        from tandem.bench.cluster_mixed import write_checkpoint

        write_checkpoint(a.model_shape, a.checkpoint)
    batches = [int(b) for b in a.batches.split(",")]
    per_row = -(-(a.context + a.steps + 4) // a.block_size)
    args = dict(checkpoint=a.checkpoint, batches=batches, context=a.context, steps=a.steps, block_size=a.block_size,
                num_blocks=per_row * max(batches), out_dir=os.path.dirname(os.path.abspath(a.out)))
    split = split_steps(args, a.tp)  # first: the one-rank runner below holds a device's memory
    runner = _runner(a.checkpoint, _device(0), None, args["num_blocks"], a.block_size)
    if runner.device.type == "cuda":
        runner.enable_cuda_graphs(max(batches), a.context + a.steps + 4)
    whole = {b: _steps_ms(runner, b, a.context, a.steps) for b in batches}
    label = os.path.basename(os.path.normpath(a.checkpoint))
    rows = []
    for b in batches:
        rows.append(dict(workload=f"decode_step_{label}", tp=1, batch=b, ms=whole[b], ratio=None))
        rows.append(dict(workload=f"decode_step_{label}", tp=a.tp, batch=b, ms=split[b], ratio=split[b] / whole[b]))
    for row in rows:
        print(row)
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
