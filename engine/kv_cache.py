"""The paged KV pool: one tensor holding every layer's K and V blocks.

    kv  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

One tensor (rather than one per layer) so a transfer can move block ids across
all layers with a single gather/scatter (``tandem.kernels.ops.gather_blocks``).

On the CPU the pool can live in a file (normally under /dev/shm) so that a
second process maps the very same memory: the creator calls ``create_shared``
and later ``close()`` (which unlinks the file); a peer receives ``layout()``
plus the path (e.g. in a msgpack message) and calls
``KVCachePool.attach_shared(path, **layout)``. Which blocks a peer may touch is
decided by the block allocator and the transfer protocol, not here.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any

import torch


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
        dtype: torch.dtype | str,
    ) -> "KVCachePool":
        """Create (or truncate) the file at ``path`` with the pool's exact size, zeroed, and map it."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu", path, create=True)

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


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown KV cache dtype {dtype!r}")
    return resolved
