"""Tensor parallelism within a worker: one scheduler, one model split over N ranks.

A worker started with ``--tensor-parallel-size N`` is N processes, one per device (one per
CPU process on the CPU). Rank 0, the leader, is the worker: its scheduler, Redis, sampling and
streams are as with one rank. Ranks 1..N-1 follow: each holds its slice of the model and of
the KV pool, and runs every forward the leader runs, in lockstep.

- Weights (Megatron-LM's split): qkv_proj and gate_up_proj are split by output rows: each rank
  computes its query and KV heads, and its share of the MLP's intermediate units (column
  parallel); o_proj and down_proj by input columns: each rank's partial sums are added across
  the ranks (all-reduce) before the residual add (row parallel). Embeddings, norms and lm_head
  are whole on every rank. A rank's model is the Llama-family model of its own shape
  (``shard_config``: its heads and intermediate units), loaded from its slice of the checkpoint
  (``shard_state``), with the FP8 weights' per-row scales sliced alongside.
- KV: each rank's pool holds its KV heads, under the same block ids on every rank; the block
  bookkeeping (allocator, prefix cache) is the leader's alone.
- Steps: before each forward the leader broadcasts the step (its chunks, and a token feed's rows
  and tokens), and each follower runs the same forward (``ModelRunner.follow``). Logits,
  sampling and everything after are the leader's.
- Process group: ``torch.distributed`` over a TCP rendezvous on this host, gloo on the CPU,
  NCCL on CUDA (rank r on CUDA device r), with a gloo group beside it on CUDA for the steps
  (host bytes: a follower reads one without syncing its device).
- Failure: a collective that fails (a rank died) raises ``TPGroupLost``, which no step handler
  catches: the worker exits, its supervisor restarts it whole, and its streams continue on
  another worker as after any worker's death. A follower whose leader is gone exits.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import sys

import torch
import torch.distributed as dist

from tandem.engine.config import ModelConfig
from tandem.engine.step_tokens import TokenFeed

INIT_TIMEOUT = datetime.timedelta(seconds=300)  # the ranks load the model before they meet


class TPGroupLost(BaseException):
    """A rank of the worker is gone: fatal to the worker (a BaseException: no step handler
    catches it; the supervisor restarts the worker whole)."""


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Refuse a degree the model's shape does not split into."""
    if tp_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
    uneven = [f"{name} {value}" for name, value in (("query heads", config.num_q_heads),
                                                    ("KV heads", config.num_kv_heads),
                                                    ("intermediate size", config.intermediate_size))
              if value % tp_size]
    if uneven:
        raise ValueError(f"--tensor-parallel-size {tp_size} does not divide the model's {', '.join(uneven)}")


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The shape of one rank's model: its share of the heads and intermediate units."""
    check_tp_size(config, tp_size)
    if tp_size == 1:
        return config
    return dataclasses.replace(config, num_q_heads=config.num_q_heads // tp_size,
                               num_kv_heads=config.num_kv_heads // tp_size,
                               intermediate_size=config.intermediate_size // tp_size)


def shard_state(state: dict[str, torch.Tensor], config: ModelConfig, rank: int, tp_size: int) -> dict:
    """Rank ``rank``'s slice of a whole model's engine state (``engine.loader``'s names, fused
    qkv and gate_up), for a model of ``shard_config(config, tp_size)``."""
    if tp_size == 1:
        return state
    d = config.head_dim
    q, kv, inter = config.num_q_heads * d, config.num_kv_heads * d, config.intermediate_size
    q_l, kv_l, inter_l = q // tp_size, kv // tp_size, inter // tp_size

    def rows(tensor, spans):  # concatenated row ranges (dim 0)
        return torch.cat([tensor[start : start + size] for start, size in spans]).contiguous()

    qkv_spans = [(rank * q_l, q_l), (q + rank * kv_l, kv_l), (q + kv + rank * kv_l, kv_l)]
    gate_up_spans = [(rank * inter_l, inter_l), (inter + rank * inter_l, inter_l)]
    out = {}
    for name, tensor in state.items():
        key = name.rsplit(".", 1)[0] if name.endswith((".weight", ".weight_scale", ".bias")) else name
        if key.endswith("qkv_proj"):  # column parallel: its heads' rows (and their bias, scales)
            out[name] = rows(tensor, qkv_spans)
        elif key.endswith("gate_up_proj"):  # column parallel: its units' gate rows, then up rows
            out[name] = rows(tensor, gate_up_spans)
        elif key.endswith("o_proj") and name.endswith(".weight"):  # row parallel: its heads' columns
            out[name] = tensor[:, rank * q_l : (rank + 1) * q_l].contiguous()
        elif key.endswith("down_proj") and name.endswith(".weight"):  # row parallel: its units' columns
            out[name] = tensor[:, rank * inter_l : (rank + 1) * inter_l].contiguous()
        else:  # embeddings, norms, lm_head; o/down's per-output-row scales: whole on every rank
            out[name] = tensor
    return out


class TPGroup:
    """This process's place in its worker's tensor-parallel group, and the group's collectives."""

    def __init__(self, rank: int, size: int, init_method: str, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        self.followers = []  # the leader's: its followers' processes (lead_group)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=INIT_TIMEOUT)
        # the steps themselves travel between host memories (gloo): on CUDA the device group carries
        # only the all-reduces and a feed's tokens, and a follower reads a step without a device sync
        self.host_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` across the ranks, in place (a row-parallel projection's partial sums)."""
        try:
            dist.all_reduce(tensor)
        except RuntimeError as exc:
            raise TPGroupLost(f"tensor-parallel all-reduce failed: {exc}") from exc

    def barrier(self) -> None:
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise TPGroupLost(f"tensor-parallel barrier failed: {exc}") from exc

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a KV pool's blocks: the same on every rank)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(tensor.item())

    def lead(self, chunks, feed: TokenFeed | None) -> None:
        """Leader: send the next forward's step to the followers."""
        self._broadcast(pickle.dumps((chunks, None if feed is None else (feed.rows, tuple(feed.tokens.shape)))))
        if feed is not None:
            self._broadcast_tensor(feed.tokens)

    def stop(self) -> None:
        """Leader: the followers leave their loop."""
        self._broadcast(pickle.dumps(None))

    def receive(self):
        """Follower: the next step, (chunks, feed), or None when the leader stops."""
        step = pickle.loads(self._broadcast(None))
        if step is None:
            return None
        chunks, feed = step
        if feed is not None:
            rows, shape = feed
            tokens = torch.empty(shape, dtype=torch.int64, device=self.device)
            self._broadcast_tensor(tokens)
            feed = TokenFeed(tokens, rows)
        return chunks, feed

    def _broadcast(self, payload: bytes | None) -> bytes:
        try:
            size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
            dist.broadcast(size, src=0, group=self.host_group)
            data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
                    else torch.empty(int(size.item()), dtype=torch.uint8))
            dist.broadcast(data, src=0, group=self.host_group)
        except RuntimeError as exc:
            raise TPGroupLost(f"tensor-parallel broadcast failed: {exc}") from exc
        return payload if payload is not None else data.numpy().tobytes()

    def _broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """A feed's tokens, where they are (the device group: NCCL on CUDA, gloo on the CPU)."""
        try:
            dist.broadcast(tensor, src=0)
        except RuntimeError as exc:
            raise TPGroupLost(f"tensor-parallel broadcast failed: {exc}") from exc

    def close(self) -> None:
        """Leave the group together: every rank reaches the barrier before any tears down its
        connections. A follower then ends its process at once (``os._exit``): gloo's connection
        threads, torn down by interpreter exit while the leader closes its side, abort it."""
        if not dist.is_initialized():
            return
        try:
            dist.barrier()
        except RuntimeError:
            pass  # a rank is gone already: nothing to wait for
        if not self.is_leader:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        dist.destroy_process_group()
