"""Swap instead of recompute, end to end on the CPU: under MAX_UTILIZATION with a host KV tier
(``--kv-host-cache-gb``), a paused request's KV goes to host memory and comes back when it
resumes, so it needs no prefill; every answer still equals HF transformers' greedy output. Both
layouts (disaggregated workers, one worker running both pools), with the 96-token decode pool and
the prompts of ``test_capacity_policies``."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from tests.e2e.cluster import LAYOUTS, LocalCluster
from tests.e2e.test_capacity_policies import MAX_TOKENS, POOL_TOKENS, PROMPTS, assert_nothing_held, complete_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=LAYOUTS)
def swapping(tiny_llama, tmp_path_factory, request):
    c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp("logs-swap")), request.param, tokens_per_block=4,
                     max_num_tokens=32, max_seq_len=64, max_input_len=40, max_tokens_in_paged_kv_cache=POOL_TOKENS,
                     capacity_scheduler_policy="MAX_UTILIZATION", kv_host_cache_gb=0.001).start()
    yield c
    c.stop()


def test_paused_requests_resume_from_host_memory_with_unchanged_output(swapping, tiny_llama, hf_greedy):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = {p: hf_greedy(tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS}
    for _ in range(3):  # a burst pauses requests only if enough of it runs at once
        choices = asyncio.run(complete_all(swapping.base_url, swapping.settings.model_name))
        for prompt, choice in zip(PROMPTS, choices):
            assert choice["token_ids"] == expected[prompt], prompt
        if swapping.worker("decode", "decode-0").num_preemptions:
            break
    deadline = time.monotonic() + 5
    while True:  # the record catches up within a heartbeat
        info = swapping.worker("decode", "decode-0")
        if info.num_swaps_in == info.num_swaps_out == info.num_preemptions > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # every pause saved the request's KV, and every resume took it back instead of a prefill
    assert info.num_preemptions > 0
    assert info.num_swaps_out == info.num_swaps_in == info.num_preemptions, info
    assert_nothing_held(swapping)
