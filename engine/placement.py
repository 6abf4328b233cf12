"""Where a worker runs and how big its KV pool is."""

from __future__ import annotations

import structlog
import torch

from tandem.cluster.settings import CPU_DEFAULT_KV_TOKENS, Settings

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
    settings: Settings, bytes_per_token: int, device: torch.device, gpu_cap_tokens: int | None = None
) -> int:
    """Number of KV blocks: the smaller of the token cap and the memory fraction.

    ``gpu_cap_tokens``: a default cap on a GPU when the operator set none (the
    prefill worker needs only room for the prompts in flight, and leaves the
    rest of a shared GPU to the decode worker).
    """
    block_size = settings.tokens_per_block
    candidates = []
    if settings.max_tokens_in_paged_kv_cache is not None:
        candidates.append(settings.max_tokens_in_paged_kv_cache // block_size)
    elif device.type == "cuda" and gpu_cap_tokens is not None:
        candidates.append(gpu_cap_tokens // block_size)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = free * settings.kv_cache_free_gpu_mem_fraction
        candidates.append(int(budget // (bytes_per_token * block_size)))
    elif not candidates:  # CPU default: a fixed count, never less than one full-length sequence
        candidates.append(max(CPU_DEFAULT_KV_TOKENS, settings.max_seq_len or 0) // block_size)
    num_blocks = min(candidates)
    log.info(
        "kv pool sized",
        bytes_per_token=bytes_per_token,
        num_blocks=num_blocks,
        block_size=block_size,
        memory_bytes=num_blocks * block_size * bytes_per_token,
    )
    return num_blocks


def build_runner(settings: Settings, shm_path: str | None = None, gpu_cap_tokens: int | None = None):
    """Load the model, then size its KV pool from what memory the weights left. ``shm_path``: pool in that file."""
    from tandem.engine.kv_cache import KVCachePool
    from tandem.engine.loader import load_model
    from tandem.engine.runner import ModelRunner

    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    model, config = load_model(settings.model, dtype=dtype, device=device,
                               max_attention_window=settings.max_attention_window_size,
                               quantization=settings.quantization)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # return the loader's temporaries before measuring free memory
    num_blocks = kv_pool_blocks(settings, config.kv_bytes_per_token(dtype), device, gpu_cap_tokens)
    layout = dict(
        num_layers=config.num_layers,
        num_blocks=num_blocks,
        block_size=settings.tokens_per_block,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
    if shm_path is not None:
        pool = KVCachePool.create_shared(shm_path, **layout)
    else:
        pool = KVCachePool(**layout, device=device)
    return ModelRunner.from_model(model, config, num_blocks, settings.tokens_per_block, kv_pool=pool)
