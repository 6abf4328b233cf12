"""The names of full KV blocks (plain Python, no torch): a prompt block is named by a hash
chained over the prefix, ``hash(block i) = H(hash(block i-1), token ids of block i)``
(blake2b over the token ids, stable across processes, unlike Python's ``hash``), so two prompts
share block i's hash exactly when they share every token up to the end of block i. Prefix
caches key their blocks by them (``tandem.engine.prefix_cache``) and routers look prompts up by
them (``tandem.cluster.prefix_index``).
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16
_ROOT = b"\0" * HASH_BYTES


def block_hashes(token_ids: list[int], block_size: int, salt: str = "", parent: bytes | None = None) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``. ``salt`` names what else the KV depends
    on (a LoRA adapter's digest: the same tokens under two adapters have different KV), and starts
    the chain: blocks of different salts never share a hash. ``parent``: the hash of the block
    before ``token_ids`` (the chain goes on from it; its salt is in it already)."""
    hashes = []
    if parent is None:
        parent = _ROOT
        if salt:
            parent = hashlib.blake2b(salt.encode(), digest_size=HASH_BYTES, person=b"tandem-salt").digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        digest.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


def num_reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks a prompt may take from a cache: the last token is always recomputed (its logits)."""
    return max(num_prompt_tokens - 1, 0) // block_size
