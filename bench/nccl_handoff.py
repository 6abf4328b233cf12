"""KV handoff over the nccl transport between two GPUs, against a plain device-to-device copy.

    python3 -m bench.nccl_handoff --out $OUT/nccl_handoff.json     (needs 2 GPUs: nvidia-h200-x2)

The decode side (a process on cuda:0) exports a KV pool at the llama2-7b shape
(32 layers, 32 KV heads, head_dim 128, bf16, 16-token blocks); the prefill side
(a process on cuda:1) pushes a 2048-token prompt's 128 blocks through
``KVSender`` in 8 chunks of 256 tokens, as the prefill worker does, and times
from the first send until every chunk is acknowledged. The same bytes copied
with one ``Tensor.to("cuda:0")`` from cuda:1 are the anchor (target >= 60% of
it).

Then the TTFT share, as the prefill worker runs it: the prefill side builds
the llama2-7b shape with random bf16 weights on cuda:1 and prefills the
2048-token prompt with ``--max-num-tokens`` 2048 (one chunk) and 512 (four
chunks, each chunk's blocks sent right after its forward, so transfers
overlap the next forward). ``tail`` is the time from the last forward's end
to the decode side's last ack: the delay the handoff adds before decode can
start (the first token itself is published at sampling time, before the
handoff ends). Reported as a fraction of the prefill time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 128, 16
PROMPT, CHUNK = 2048, 256
NUM_BLOCKS = PROMPT // BLOCK


def _layout(num_blocks: int) -> dict:
    return dict(num_layers=LAYERS, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=KV_HEADS,
                head_dim=HEAD_DIM, dtype=torch.bfloat16)


def _decode_side(endpoint_queue, done_event) -> None:
    from engine.kv_cache import KVCachePool
    from kvtransfer.nccl import NcclTransport

    torch.cuda.set_device(0)
    pool = KVCachePool(**_layout(NUM_BLOCKS + 16), device="cuda:0")
    transport = NcclTransport(timeout_s=60)
    endpoint_queue.put(transport.export_pool(pool))
    done_event.wait(600)
    transport.close()


def _prefill_side(endpoint, result_queue, reps: int) -> None:
    from kvtransfer import KVPoll, KVSender
    from kvtransfer.nccl import NcclTransport

    torch.cuda.set_device(1)
    src = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, device="cuda:1").to(torch.bfloat16)
    connection = NcclTransport(timeout_s=60).connect(endpoint)
    blocks_per_chunk = CHUNK // BLOCK
    times = []
    for rep in range(reps + 1):  # the first forms the pair and warms up
        sender = KVSender(connection, list(range(8, 8 + NUM_BLOCKS)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for first in range(0, NUM_BLOCKS, blocks_per_chunk):
            sender.send_blocks(src, list(range(first, first + blocks_per_chunk)), first)
            sender.poll()
        sender.finish()
        while (status := sender.poll()) is KVPoll.TRANSFERRING:
            pass
        if status is not KVPoll.SUCCESS:
            result_queue.put({"error": sender.error})
            return
        if rep:
            times.append(time.perf_counter() - t0)
    times.sort()
    result = {"handoff_s": times[len(times) // 2], "bytes": src.numel() * src.element_size()}
    del src
    torch.cuda.empty_cache()
    result["prefill"] = _prefill_tail(connection, reps)
    result_queue.put(result)


def _prefill_tail(connection, reps: int) -> dict:
    """Prefill a 2048-token prompt on the llama2-7b shape, sending each chunk's blocks after its forward."""
    from bench.engine import build_runner
    from engine.attention import SeqChunk
    from kvtransfer import KVPoll, KVSender

    runner = build_runner("llama2-7b", num_tokens=PROMPT + 256, max_seq_len=PROMPT, max_batch_size=1)
    runner.graphs = None  # prefill does not use the decode graphs
    prompt = torch.randint(3, runner.config.vocab_size, (PROMPT,)).tolist()
    blocks = list(range(NUM_BLOCKS))
    out = {}
    for chunk in (2048, 512):
        forward_s, tail_s, plain_s = [], [], []
        for rep in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for start in range(0, PROMPT, chunk):
                runner.forward([SeqChunk(prompt[start:start + chunk], start, blocks)])
            torch.cuda.synchronize()
            if rep:
                plain_s.append(time.perf_counter() - t0)
            sender = KVSender(connection, list(range(8, 8 + NUM_BLOCKS)))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for start in range(0, PROMPT, chunk):
                runner.forward([SeqChunk(prompt[start:start + chunk], start, blocks)])
                first, last = start // BLOCK, (start + chunk) // BLOCK
                sender.send_blocks(runner.kv_pool.kv, blocks[first:last], first)
                sender.poll()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            sender.finish()
            while (status := sender.poll()) is KVPoll.TRANSFERRING:
                pass
            t2 = time.perf_counter()
            if status is not KVPoll.SUCCESS:
                return {"error": sender.error}
            if rep:
                forward_s.append(t1 - t0)
                tail_s.append(t2 - t1)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        out[chunk] = {"prefill_s": med(plain_s), "prefill_while_sending_s": med(forward_s), "tail_s": med(tail_s)}
    return out


def device_copy_s(num_bytes: int, reps: int = 10) -> float:
    a = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda:1").normal_()
    b = torch.empty_like(a, device="cuda:0")
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
    return sorted(times[2:])[reps // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "nccl_handoff.json"))
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA devices")
    ctx = mp.get_context("spawn")
    endpoints, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    decode = ctx.Process(target=_decode_side, args=(endpoints, done))
    decode.start()
    prefill = ctx.Process(target=_prefill_side, args=(endpoints.get(timeout=300), results, args.reps))
    prefill.start()
    result = results.get(timeout=600)
    done.set()
    prefill.join(60)
    decode.join(60)
    if "error" in result:
        raise SystemExit(f"handoff failed: {result['error']}")
    copy_s = device_copy_s(result["bytes"])
    handoff_gbps = result["bytes"] / result["handoff_s"] / 1e9
    copy_gbps = result["bytes"] / copy_s / 1e9
    rows = [
        dict(workload="nccl_handoff_2048", model="llama2-7b", metric="GBps", value=handoff_gbps,
             anchor="d2d_copy_GBps", anchor_value=copy_gbps, ratio=handoff_gbps / copy_gbps),
        dict(workload="nccl_handoff_2048", model="llama2-7b", metric="ms", value=result["handoff_s"] * 1e3,
             anchor=None, anchor_value=None, ratio=None),
    ]
    for chunk, p in result.get("prefill", {}).items():
        if chunk == "error":
            rows.append(dict(workload="nccl_prefill_tail", model="llama2-7b", metric="error", value=p))
            continue
        added = (p["prefill_while_sending_s"] + p["tail_s"]) / p["prefill_s"] - 1
        rows.append(dict(workload=f"nccl_prefill_tail_chunk{chunk}", model="llama2-7b", metric="added_ttft_fraction",
                         value=added, anchor="prefill_ms", anchor_value=p["prefill_s"] * 1e3, ratio=None))
        rows.append(dict(workload=f"nccl_prefill_tail_chunk{chunk}", model="llama2-7b", metric="tail_ms",
                         value=p["tail_s"] * 1e3, anchor="prefill_while_sending_ms",
                         anchor_value=p["prefill_while_sending_s"] * 1e3, ratio=None))
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
