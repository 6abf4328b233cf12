"""Where a worker runs and how big its KV pool is; a split model's ranks as processes
(``engine.tensor_parallel``: ``lead_group`` starts them, ``follower_main`` is each one's life)."""

from __future__ import annotations

import multiprocessing
import os
import socket

import structlog
import torch

from tandem.cluster.settings import CPU_DEFAULT_KV_TOKENS, Settings
from tandem.engine.tensor_parallel import TPGroup, TPGroupLost

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is visible")
    return device


def device_identity(device: torch.device) -> str:
    """The same string for the same device in any process of this host, whatever
    CUDA_VISIBLE_DEVICES each has: the GPU's UUID, or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"cuda-{uuid}" if uuid is not None else ""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_transport(name: str, device: torch.device) -> str:
    """auto: cuda_ipc on a GPU, shm on the CPU. nccl is only ever asked for; it
    moves CUDA pools over NCCL and CPU pools over gloo (the pool decides)."""
    if name == "auto":
        return "cuda_ipc" if device.type == "cuda" else "shm"
    if name == "shm" and device.type == "cuda":
        raise ValueError("the shm transport moves CPU pools; use --kv-transport cuda_ipc on a GPU")
    return name


def kv_pool_blocks(
    settings: Settings, bytes_per_token: int, device: torch.device, gpu_cap_tokens: int | None = None,
    budget_bytes_per_token: int | None = None,
) -> int:
    """Number of KV blocks: the smaller of the token cap and the memory fraction.

    ``gpu_cap_tokens``: a default cap on a GPU when the operator set none (the
    prefill worker needs only room for the prompts in flight, and leaves the
    rest of a shared GPU to the decode worker). ``budget_bytes_per_token``: what a token
    of ``--max-tokens-in-paged-kv-cache`` (and the CPU default) weighs, the model dtype's
    bytes (default ``bytes_per_token``): those caps are memory budgets, so a pool of smaller
    elements (FP8) holds more tokens in them. Everything is sized by bytes.
    """
    block_size = settings.tokens_per_block
    budget = budget_bytes_per_token or bytes_per_token
    candidates = []
    if settings.max_tokens_in_paged_kv_cache is not None:
        candidates.append(settings.max_tokens_in_paged_kv_cache * budget // (bytes_per_token * block_size))
    elif device.type == "cuda" and gpu_cap_tokens is not None:
        candidates.append(gpu_cap_tokens // block_size)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = free * settings.kv_cache_free_gpu_mem_fraction
        candidates.append(int(budget // (bytes_per_token * block_size)))
    elif not candidates:  # CPU default: a fixed budget, never less than one full-length sequence
        candidates.append(max(CPU_DEFAULT_KV_TOKENS, settings.max_seq_len or 0) * budget // (bytes_per_token * block_size))
    num_blocks = min(candidates)
    log.info(
        "kv pool sized",
        bytes_per_token=bytes_per_token,
        num_blocks=num_blocks,
        block_size=block_size,
        memory_bytes=num_blocks * block_size * bytes_per_token,
    )
    return num_blocks


def check_fp8_kv_device(device: torch.device) -> None:
    """An FP8 KV cache on CUDA needs E4M3 conversions in the kernels: sm89 (Ada) or later."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later; {name} is "
                           f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")


def build_runner(settings: Settings, shm_path: str | None = None, gpu_cap_tokens: int | None = None, tp=None,
                 tp_size: int = 1, shared_ranks: bool = False):
    """Load the model, then size its KV pool from what memory the weights left. ``shm_path``: pool in that file.
    An FP8 pool (``--kv-cache-dtype fp8``) gets its scales first (the checkpoint's, else one
    calibration forward: ``tandem.engine.kv_scales``), from the same model on every worker.

    With ``tp_size`` N > 1 (``engine.tensor_parallel``) the caller is rank 0 and starts the other
    ranks here (``tp``: a follower's own group); each loads its slice of the model, and the pool
    has the same number of blocks on every rank. ``shared_ranks``: every rank's pool is a file
    (rank 0's at ``shm_path``), which rank 0 maps too: the shm transport moves the KV of all
    the heads (``ModelRunner.handoff_kv``)."""
    from tandem.engine.kv_cache import KVCachePool, resolve_kv_dtype
    from tandem.engine.kv_scales import kv_scales
    from tandem.kernels import compile_watch

    compile_watch.install()  # counts the start-up's compilations; the worker loop's are warnings
    from tandem.engine.loader import load_model
    from tandem.engine.runner import ModelRunner

    device = resolve_device(settings.device)
    if tp is not None or tp_size > 1:
        device = rank_device(device, 0 if tp is None else tp.rank)
        if tp is None:
            tp = lead_group(settings, device, tp_size, shm_path if shared_ranks else None)
    dtype = resolve_dtype(settings.dtype, device)
    model, config = load_model(settings.model, dtype=dtype, device=device,
                               max_attention_window=settings.max_attention_window_size,
                               quantization=settings.quantization,
                               tp_rank=0 if tp is None else tp.rank, tp_size=1 if tp is None else tp.size)
    kv_dtype = resolve_kv_dtype(settings.kv_cache_dtype, dtype)
    scales = {}
    if kv_dtype != dtype:
        check_fp8_kv_device(device)
        scales = dict(zip(("k_scale", "v_scale"), kv_scales(model, config, settings.model,
                                                            settings.tokenizer or settings.model, device, dtype)))
    lora_weights = None
    if settings.enable_lora:  # the adapters' device slots, before the KV pool takes what memory is left
        from tandem.engine.lora_weights import LoraWeights

        lora_weights = LoraWeights(config, settings.max_loras, settings.max_lora_rank, dtype, device)
        if tp is None:  # the A stacks under the weights now: the pool is sized after (LoraWeights.fuse_into)
            lora_weights.fuse_into(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # return the loader's temporaries before measuring free memory
    num_blocks = kv_pool_blocks(settings, config.kv_bytes_per_token(kv_dtype), device, gpu_cap_tokens,
                                budget_bytes_per_token=config.kv_bytes_per_token(dtype))
    if tp is not None:  # the same block ids on every rank
        num_blocks = tp.agree_min(num_blocks)
    layout = dict(
        num_layers=config.num_layers,
        num_blocks=num_blocks,
        block_size=settings.tokens_per_block,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=kv_dtype,
    )
    if shm_path is not None:
        pool = KVCachePool.create_shared(shm_path, **layout, **scales)
    else:
        pool = KVCachePool(**layout, device=device, **scales)
    runner = ModelRunner.from_model(model, config, num_blocks, settings.tokens_per_block, kv_pool=pool, tp=tp)
    if tp is not None and shared_ranks:  # every rank's file exists once all passed here
        tp.barrier()
        if tp.is_leader:
            runner.attach_rank_pools([KVCachePool.attach_shared(rank_pool_path(shm_path, rank), **layout)
                                      for rank in range(1, tp.size)])
    if lora_weights is not None:
        runner.enable_lora(settings.max_loras, settings.max_lora_rank, settings.max_cpu_loras, weights=lora_weights)
    return runner


# ---- a worker's ranks as processes ---------------------------------------------------------


def lead_group(settings, device: torch.device, size: int, pool_path: str | None = None) -> TPGroup:
    """Rank 0 of a worker of ``size`` ranks: start the followers (one process each, spawned, its
    device CUDA device r of the worker's) and meet them -> the group. ``pool_path``: each follower
    keeps its KV pool in the file ``rank_pool_path(pool_path, r)`` (the shm transport: the pools
    of split models hand KV over through their ranks' files). The followers are daemons: they end
    with this process, and end it (``TPGroupLost``) if one dies."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    followers = [ctx.Process(target=follower_main, args=(settings, rank, size, init_method, pool_path), daemon=True,
                             name=f"tp-rank-{rank}") for rank in range(1, size)]
    for proc in followers:
        proc.start()
    group = TPGroup(0, size, init_method, device)
    group.followers = followers
    return group


def rank_pool_path(pool_path: str, rank: int) -> str:
    """Where rank ``rank`` of a worker whose pool file is ``pool_path`` keeps its own (rank 0: there)."""
    return pool_path if rank == 0 else f"{pool_path}.rank{rank}"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: CUDA device r of the worker's visible ones, or the CPU."""
    if device.type != "cuda":
        return device
    if torch.cuda.device_count() <= rank:
        raise ValueError(f"tensor-parallel rank {rank} needs CUDA device {rank}; "
                         f"{torch.cuda.device_count()} are visible to the worker")
    return torch.device("cuda", rank)


def follower_main(settings, rank: int, size: int, init_method: str, pool_path: str | None) -> None:
    """A follower rank's process: its slice of the model and KV pool, then every forward its
    leader runs, until the leader stops (or is gone: then it exits non-zero)."""
    if settings.cpu_threads:
        torch.set_num_threads(settings.cpu_threads)
    group = TPGroup(rank, size, init_method, rank_device(resolve_device(settings.device), rank))
    runner = build_runner(settings, shm_path=None if pool_path is None else rank_pool_path(pool_path, rank),
                          tp=group, shared_ranks=pool_path is not None)
    try:
        runner.follow()
    except TPGroupLost:
        runner.kv_pool.close()  # its file, if it has one, goes with it
        os._exit(1)
    runner.kv_pool.close()
    group.close()
