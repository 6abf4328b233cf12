"""The host KV tier's copies against the link they cross.

    python3 -m tandem.bench.host_tier [--blocks 512] [--kv-dtype bf16|fp8] --out host_tier.json

A KV pool of the llama3-8b shape (32 layers, 8 KV heads of 128, 16-token blocks; random
contents), then: the link's bandwidth each way (one large pinned <-> device copy), the tier's
stores (``HostKVTier.store`` of ``--blocks`` evicted blocks, checksums summed on the device, until
their copies have landed) and loads (``load`` into fresh blocks, checksums compared on the device,
until ``HostLoad.wait`` returns), each as bytes per second and as a fraction of the link's rate in
the same direction, the host's time issuing each (what the worker's loop spends on it), and the
loaded blocks checked against the stored ones.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.engine.host_kv_tier import HostKVTier
from tandem.engine.kv_cache import KVCachePool

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def link_GBps(nbytes: int, to_host: bool, reps: int = 5) -> float:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        (host.copy_(device, non_blocking=True) if to_host else device.copy_(host, non_blocking=True))
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="host_tier.json")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.kv_dtype == "bf16" else torch.float8_e4m3fn
    scales = {} if args.kv_dtype == "bf16" else {"k_scale": torch.ones(LAYERS, KV_HEADS, device="cuda"),
                                                  "v_scale": torch.ones(LAYERS, KV_HEADS, device="cuda")}
    n = args.blocks
    pool = KVCachePool(LAYERS, 3 * n, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cuda", **scales)
    pool.kv.view(torch.uint8).random_(0, 256)
    tier = HostKVTier(pool, (args.reps + 1) * n * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * pool.kv.element_size())
    nbytes = n * tier.block_bytes
    result = {"blocks": n, "block_bytes": tier.block_bytes, "kv_dtype": args.kv_dtype,
              "link_to_host_GBps": link_GBps(nbytes, True), "link_to_device_GBps": link_GBps(nbytes, False)}
    stores, loads, issues = [], [], []
    for rep in range(args.reps + 1):  # the first of each is a warm-up
        hashes = [f"{rep}:{i}".encode() for i in range(n)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        tier.store(list(zip(hashes, range(n))))
        store_issue = time.perf_counter() - start
        torch.cuda.synchronize()  # every copy has landed
        stores.append(time.perf_counter() - start)
        tier.poll()
        start = time.perf_counter()
        load = tier.load(hashes, list(range(n, 2 * n)))
        issues.append((store_issue, time.perf_counter() - start))
        assert load.wait() == n
        loads.append(time.perf_counter() - start)
    raw = pool.kv.view(torch.uint8)
    result["loaded_equal_stored"] = bool(torch.equal(raw[:, :, :n], raw[:, :, n : 2 * n]))
    result["store_GBps"] = nbytes / min(stores[1:]) / 1e9
    result["load_GBps"] = nbytes / min(loads[1:]) / 1e9  # checksums compared, blocks in the pool
    result["store_fraction_of_link"] = result["store_GBps"] / result["link_to_host_GBps"]
    result["load_fraction_of_link"] = result["load_GBps"] / result["link_to_device_GBps"]
    result["store_issue_ms"] = min(s for s, _ in issues[1:]) * 1e3  # the host's part
    result["load_issue_ms"] = min(l for _, l in issues[1:]) * 1e3
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
