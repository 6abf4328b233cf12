"""KV handoff over the nccl transport between two GPUs, against a plain device-to-device copy.

    python3 -m tandem.bench.nccl_handoff --out $OUT/nccl_handoff.json     (needs 2 GPUs: nvidia-h200-x2)

The decode side (a process on cuda:0) exports a KV pool at the llama2-7b shape
(32 layers, 32 KV heads, head_dim 128, bf16, 16-token blocks); the prefill side
(a process on cuda:1) pushes a 2048-token prompt's 128 blocks through
``KVSender``, in one chunk (the default ``--max-num-tokens`` 2048) and in 8
chunks of 256 tokens, timed from the first send until every chunk is
acknowledged. Anchors: the same bytes copied with one ``copy_`` from cuda:1 to
cuda:0 (the issue's target: >= 60% of it), and a bare torch.distributed NCCL
send/recv of those bytes (what NCCL gives without our protocol).

Then the TTFT, as the prefill worker runs it: the llama2-7b shape with random
bf16 weights on cuda:1 prefills the 2048-token prompt in one chunk and in four
of 512, sending each chunk's blocks right after its forward, then samples the
first token (one host sync on the compute stream; the worker publishes it
then). ``added_ttft_fraction``: that TTFT against the same prefill without
sending. ``decode_start_delay_fraction``: the time from the first token until
the last ack (when the decode side may start), over the TTFT.
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
    from tandem.engine.kv_cache import KVCachePool
    from tandem.kvtransfer.nccl import NcclTransport

    torch.cuda.set_device(0)
    pool = KVCachePool(**_layout(NUM_BLOCKS + 16), device="cuda:0")
    transport = NcclTransport(timeout_s=60)
    endpoint_queue.put(transport.export_pool(pool))
    done_event.wait(600)
    transport.close()


def _prefill_side(endpoint, result_queue, reps: int) -> None:
    from tandem.kvtransfer.nccl import NcclTransport

    torch.cuda.set_device(1)
    src = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, device="cuda:1").to(torch.bfloat16)
    connection = NcclTransport(timeout_s=60).connect(endpoint)
    result = {"bytes": src.numel() * src.element_size()}
    for chunk in (PROMPT, CHUNK):  # one chunk (the default --max-num-tokens 2048), then 8
        seconds = _handoff_s(connection, src, chunk, reps)
        if isinstance(seconds, str):
            result_queue.put({"error": seconds})
            return
        result[f"handoff_s_chunk{chunk}"] = seconds
    del src
    torch.cuda.empty_cache()
    result["prefill"] = _prefill_tail(connection, reps)
    result_queue.put(result)


def _trace_side(endpoint, out_path: str) -> None:
    """Diagnostics: per-chunk host timeline of 8 back-to-back chunks (send call, ack seen)."""
    from tandem.kvtransfer import KVSender
    from tandem.kvtransfer.nccl import NcclTransport

    torch.cuda.set_device(1)
    src = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, device="cuda:1").to(torch.bfloat16)
    connection = NcclTransport(timeout_s=60).connect(endpoint)
    per_chunk = CHUNK // BLOCK
    reps = []
    for _ in range(3):
        sender = KVSender(connection, list(range(8, 8 + NUM_BLOCKS)))
        torch.cuda.synchronize()
        t0, marks = time.perf_counter(), []
        for first in range(0, NUM_BLOCKS, per_chunk):
            a = time.perf_counter()
            sender.send_blocks(src, list(range(first, first + per_chunk)), first)
            marks.append(("send", first // per_chunk, a - t0, time.perf_counter() - t0))
        transfers = list(sender._in_flight)
        acked = set()
        while len(acked) < len(transfers):
            for i, t in enumerate(transfers):
                if i not in acked and t.done():
                    acked.add(i)
                    marks.append(("acked", i, time.perf_counter() - t0))
        reps.append(marks)
    with open(out_path, "w") as f:
        json.dump(reps, f)
    for mark in reps[-1]:
        print("sender", mark)


def _handoff_s(connection, src, chunk: int, reps: int):
    from tandem.kvtransfer import KVPoll, KVSender

    blocks_per_chunk = chunk // BLOCK
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
            return sender.error
        if rep:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _prefill_tail(connection, reps: int) -> dict:
    """As the prefill worker runs it: forward each chunk, send its blocks, sample the
    first token after the last (one host sync on the compute stream), then wait for
    the acks. TTFT = until the first token is on the host; the rest is the delay
    before the decode side can start."""
    from tandem.bench.engine import build_runner
    from tandem.engine.attention import SeqChunk
    from tandem.kvtransfer import KVPoll, KVSender

    runner = build_runner("llama2-7b", num_tokens=PROMPT + 256, max_seq_len=PROMPT, max_batch_size=1)
    runner.graphs = None  # prefill does not use the decode graphs
    prompt = torch.randint(3, runner.config.vocab_size, (PROMPT,)).tolist()
    blocks = list(range(NUM_BLOCKS))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731

    def prefill(chunk: int, sender) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for start in range(0, PROMPT, chunk):
            logits = runner.forward([SeqChunk(prompt[start:start + chunk], start, blocks)])
            if sender is not None:
                first = start // BLOCK
                sender.send_blocks(runner.kv_pool.kv, blocks[first:(start + chunk) // BLOCK], first)
                sender.poll()
        logits.argmax().item()
        return time.perf_counter() - t0

    out = {}
    for chunk in (PROMPT, 512):
        plain, ttft, delay = [], [], []
        for rep in range(reps + 1):
            plain_s = prefill(chunk, None)
            sender = KVSender(connection, list(range(8, 8 + NUM_BLOCKS)))
            t0 = time.perf_counter()
            ttft_s = prefill(chunk, sender)
            sender.finish()
            while (status := sender.poll()) is KVPoll.TRANSFERRING:
                pass
            acked_s = time.perf_counter() - t0
            if status is not KVPoll.SUCCESS:
                return {"error": sender.error}
            if rep:
                plain.append(plain_s)
                ttft.append(ttft_s)
                delay.append(acked_s - ttft_s)
        out[chunk] = {"ttft_plain_s": med(plain), "ttft_s": med(ttft), "decode_start_delay_s": med(delay)}
    return out


def _raw_p2p(rank: int, port_queue, num_bytes: int, reps: int, result_queue) -> None:
    """torch.distributed send/recv of the same bytes on a pair group, without our protocol."""
    import datetime

    import torch.distributed as dist

    torch.cuda.set_device(rank)  # rank 0 receives on cuda:0, rank 1 sends from cuda:1
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port_queue.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", port_queue.get(), is_master=False)
    group = dist.ProcessGroupNCCL(dist.PrefixStore("raw/", store), rank, 2, datetime.timedelta(seconds=60))
    buf = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for rep in range(reps + 2):
        torch.cuda.synchronize()
        group.barrier().wait()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        work = group.recv([buf], 1, 0) if rank == 0 else group.send([buf], 0, 0)
        work.wait()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        result_queue.put(sorted(times[2:])[reps // 2])
    group.barrier().wait()


def raw_p2p_s(ctx, num_bytes: int, reps: int) -> float:
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_raw_p2p, args=(rank, ports, num_bytes, reps, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    seconds = results.get(timeout=300)
    for proc in procs:
        proc.join(60)
    return seconds


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
    parser.add_argument("--out", default="nccl_handoff.json")
    parser.add_argument("--trace", action="store_true", help="only the per-chunk timelines (diagnostics)")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA devices")
    ctx = mp.get_context("spawn")
    if args.trace:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        trace_path = os.path.join(out_dir, "recv_trace.json")
        os.environ["TANDEM_KV_TRACE"] = trace_path  # the decode side's --kv-trace (tandem.cluster.settings)
        endpoints, done = ctx.Queue(), ctx.Event()
        decode = ctx.Process(target=_decode_side, args=(endpoints, done))
        decode.start()
        sender = ctx.Process(target=_trace_side, args=(endpoints.get(timeout=300), os.path.join(out_dir, "send_trace.json")))
        sender.start()
        sender.join(300)
        done.set()
        decode.join(60)
        with open(trace_path) as f:
            trace = json.load(f)
        t0 = trace[0][2]
        for seq, what, t in trace[-48:]:
            print("receiver", seq, what, round((t - t0) * 1e3, 3))
        return 0
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
    raw_s = raw_p2p_s(ctx, result["bytes"], args.reps)
    copy_s = device_copy_s(result["bytes"])
    copy_gbps = result["bytes"] / copy_s / 1e9

    def row(workload, metric, value, anchor=None, anchor_value=None, ratio=None):
        return dict(workload=workload, model="llama2-7b", metric=metric, value=value, anchor=anchor,
                    anchor_value=anchor_value, ratio=ratio)

    rows = [row("nccl_p2p_raw_2048", "GBps", result["bytes"] / raw_s / 1e9, "d2d_copy_GBps", copy_gbps,
                result["bytes"] / raw_s / 1e9 / copy_gbps)]
    for chunk in (PROMPT, CHUNK):
        gbps = result["bytes"] / result[f"handoff_s_chunk{chunk}"] / 1e9
        rows.append(row(f"nccl_handoff_2048_chunk{chunk}", "GBps", gbps, "d2d_copy_GBps", copy_gbps, gbps / copy_gbps))
    for chunk, p in result["prefill"].items():
        if chunk == "error":
            rows.append(row("nccl_prefill", "error", p))
            continue
        plain = p["ttft_plain_s"]
        rows.append(row(f"nccl_prefill_2048_chunk{chunk}", "added_ttft_fraction", p["ttft_s"] / plain - 1,
                        "ttft_without_handoff_ms", plain * 1e3, None))
        rows.append(row(f"nccl_prefill_2048_chunk{chunk}", "decode_start_delay_fraction",
                        p["decode_start_delay_s"] / plain, "ttft_without_handoff_ms", plain * 1e3, None))
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
