"""A decode scheduler with a swap space (``tandem.decode.swap``) over a real host tier and KV pool
on the CPU: a paused request's blocks come back byte for byte into new blocks and it decodes on
with no prefill; one whose saved blocks the tier lost goes to a prefill as before; an aborted
paused request leaves nothing in the tier."""

from __future__ import annotations

import pytest
import torch

from tandem.cluster.messages import GenerateRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.swap import SwapSpace
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.host_kv_tier import HostKVTier
from tandem.engine.kv_cache import KVCachePool

BS = 4


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _setup(num_blocks=12, device="cpu"):
    pool = KVCachePool(2, num_blocks, BS, 2, 8, torch.float32, device)
    pool.kv.normal_()
    tier = HostKVTier(pool, 1 << 20)
    alloc = BlockAllocator(num_blocks, BS)
    sched = DecodeScheduler(alloc, max_batch_size=4, max_seq_len=64, eos_token_ids=[2],
                            policy="MAX_UTILIZATION", swap=SwapSpace(tier, BS))
    return pool, tier, alloc, sched


def _running(sched, rid: str, prompt_len: int = 9) -> DecodeRequest:
    request = DecodeRequest(spec=GenerateRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(0.0), 20))
    sched.add(request)
    assert request in sched.schedule_prefills()
    sched.on_prefill_done(request, 7, None)
    return request


@pytest.mark.parametrize("device", DEVICES)
def test_a_paused_request_resumes_from_host_memory_without_a_prefill(device):
    pool, tier, alloc, sched = _setup(device=device)
    request = _running(sched, "a")  # 10 tokens: its KV (9 tokens) fills blocks 0-2
    kv = pool.kv[:, :, request.block_ids[:3]].clone()
    sched.pause(request)
    assert sched.swap.num_swapped_out == 1 and len(tier) == 3
    pool.kv[:, :, :].zero_()  # the freed blocks are reused by others
    assert sched.schedule_prefills() == []  # admitted again: no prefill to dispatch
    assert request.status is RequestStatus.DECODING and request in sched.running
    assert torch.equal(pool.kv[:, :, request.block_ids[:3]], kv)
    assert sched.swap.num_swapped_in == 1 and len(tier) == 0  # its host copy is dropped once back
    assert sched.schedule_decode() == [request]


def test_a_request_whose_blocks_the_tier_lost_is_recomputed():
    _, tier, _, sched = _setup()
    request = _running(sched, "a")
    sched.pause(request)
    tier.drop(b"swap:a:1")
    assert sched.schedule_prefills() == [request]  # to a prefill worker, as without the tier
    assert request.status is RequestStatus.PREFILLING and sched.swap.num_swapped_in == 0
    assert len(tier) == 0


def test_an_aborted_paused_request_leaves_nothing_behind():
    _, tier, alloc, sched = _setup()
    request = _running(sched, "a")
    sched.pause(request)
    sched.abort("a")
    assert len(tier) == 0 and alloc.num_free == alloc.num_total
