"""The paged KV pool: one tensor holding every layer's K and V blocks.

    kv  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

One tensor (rather than one per layer) so a transfer can move block ids across
all layers with a single gather/scatter (``tandem.kernels.ops.gather_blocks``).

An FP8 pool (``dtype`` float8_e4m3fn, ``--kv-cache-dtype fp8``) holds E4M3 codes, one byte
per element, with fp32 scales per layer and KV head (``k_scale``, ``v_scale``
[num_layers, num_kv_heads], chosen by ``tandem.engine.kv_scales``): the attention ops read
code * scale. ``kv_format()`` names what a peer must agree on to exchange blocks with this
pool (the dtype and a digest of the scales); the transports put it in their endpoints.

On the CPU the pool can live in a file (normally under /dev/shm) so that a
second process maps the very same memory: the creator calls ``create_shared``
and later ``close()`` (which unlinks the file); a peer receives ``layout()``
plus the path (e.g. in a msgpack message) and calls
``KVCachePool.attach_shared(path, **layout)``. Which blocks a peer may touch is
decided by the block allocator and the transfer protocol, not here.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from typing import Any

import torch

from tandem.cluster.settings import KV_CACHE_DTYPES


class KVCachePool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        device: torch.device | str = "cpu",
        shm_path: str | None = None,
        *,
        create: bool = True,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = _as_dtype(dtype)
        self.device = torch.device(device)
        self.shm_path = shm_path
        self.owns_file = shm_path is not None and create
        self.k_scale, self.v_scale = self._scales(k_scale, v_scale)
        # each layer's views, made once (a forward asks every layer for them)
        self._layer_scales = [(None, None)] * num_layers if self.k_scale is None else list(
            zip(self.k_scale.unbind(0), self.v_scale.unbind(0)))
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if shm_path is None:
            # zeros, not empty: kernels may load (then mask) slots never written
            self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
            return
        if self.device.type != "cpu":
            raise ValueError(f"a shared-memory KV pool must be on the CPU, not {self.device}")
        numel = math.prod(shape)
        num_bytes = numel * torch.empty((), dtype=self.dtype).element_size()
        if create:
            _create_zeroed_file(shm_path, num_bytes)
        else:
            actual = os.path.getsize(shm_path)  # FileNotFoundError names the path
            if actual != num_bytes:
                raise ValueError(
                    f"shared KV pool {shm_path!r} has {actual} bytes but layout {self.layout()} needs {num_bytes}"
                )
        # shared=True maps the file MAP_SHARED: writes are visible to every mapper, no copy
        flat = torch.from_file(shm_path, shared=True, size=numel, dtype=self.dtype)
        self.kv = flat.view(shape)

    @classmethod
    def create_shared(
        cls, path: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype | str, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> "KVCachePool":
        """Create (or truncate) the file at ``path`` with the pool's exact size, zeroed, and map it."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu", path, create=True,
                   k_scale=k_scale, v_scale=v_scale)

    @classmethod
    def attach_shared(
        cls, path: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype | str,
    ) -> "KVCachePool":
        """Map a pool another process created; its layout must match the file size exactly."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu", path, create=False)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (k_cache, v_cache), each a view [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> (k_scale, v_scale) [num_kv_heads] fp32 of an FP8 pool's layer; (None, None) otherwise."""
        return self._layer_scales[layer_idx]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    def kv_format(self) -> dict[str, Any]:
        """What a peer's pool must match to exchange blocks with this one (msgpack-able): the
        element dtype and, for FP8, a digest of the scales (the codes mean nothing without them)."""
        digest = None
        if self.k_scale is not None:
            data = torch.cat([self.k_scale.flatten(), self.v_scale.flatten()]).cpu().numpy().tobytes()
            digest = hashlib.sha256(data).hexdigest()[:16]
        return {"dtype": str(self.dtype).removeprefix("torch."), "scales": digest}

    def layout(self) -> dict[str, Any]:
        """Plain (msgpack-able) description a peer passes to ``attach_shared``."""
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def _scales(self, k_scale, v_scale) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An FP8 pool's scales as [num_layers, num_kv_heads] fp32 on its device; a peer that only
        maps the pool to copy blocks into it (``attach_shared``) may go without."""
        if (k_scale is None) != (v_scale is None):
            raise ValueError("a KV pool takes both k_scale and v_scale, or neither")
        if k_scale is None:
            return None, None
        if not self.is_fp8:
            raise ValueError(f"KV scales belong to an FP8 pool, not one of {self.dtype}")
        shape = (self.num_layers, self.num_kv_heads)
        out = []
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(scale.shape) != shape:
                raise ValueError(f"{name} is {tuple(scale.shape)}, the pool's [num_layers, num_kv_heads] is {shape}")
            scale = scale.to(device=self.device, dtype=torch.float32).contiguous()
            if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                raise ValueError(f"{name} must be finite and positive")
            out.append(scale)
        return out[0], out[1]

    def close(self) -> None:
        """Drop this process's mapping; the creator also unlinks the file (peers keep their mappings)."""
        self.kv = None  # type: ignore[assignment]
        if self.owns_file and self.shm_path is not None and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)
        self.owns_file = False

    def __repr__(self) -> str:
        where = f"shm={self.shm_path!r}" if self.shm_path else f"device={self.device}"
        return f"KVCachePool({self.layout()}, {where})"


def _create_zeroed_file(path: str, num_bytes: int) -> None:
    # truncate to 0 first so a stale file of the same size comes back zeroed; then take the space
    # now (a sparse file on a /dev/shm too small for it would kill the process with SIGBUS later).
    # Owner only (0600, whatever the umask): the pool holds every prompt's keys and values, and
    # /dev/shm is open to every local user; a link planted at the path is not followed
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is cut by the umask, and an existing file keeps its own
    except OSError:
        os.close(fd)
        raise
    with os.fdopen(fd, "wb") as f:
        f.truncate(num_bytes)
        try:
            if hasattr(os, "posix_fallocate"):  # Linux; elsewhere the file stays sparse
                os.posix_fallocate(f.fileno(), 0, num_bytes)
        except OSError as exc:
            f.close()
            os.unlink(path)
            free = shutil.disk_usage(os.path.dirname(path) or ".").free
            raise OSError(exc.errno, f"the KV pool file {path!r} needs {num_bytes / 2**30:.2f} GiB, "
                                     f"{free / 2**30:.2f} GiB free there ({exc.strerror}): give /dev/shm more "
                                     f"room (docker: shm_size) or lower --max-tokens-in-paged-kv-cache") from None


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: "auto" is the model's dtype, "fp8" E4M3 (float8_e4m3fn)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown KV cache dtype {name!r}: one of {KV_CACHE_DTYPES}")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown KV cache dtype {dtype!r}")
    return resolved
