"""End to end on the CPU: prefix caching (with routing to the prefill worker that holds the prefix) and
sliding-window block release, through real redis, gateway, prefill and decode processes.

Greedy output must not change: with the cache it equals HF transformers' generate(), and a Mistral
checkpoint (sliding_window 24) generating far past its window equals HF's Mistral too.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.engine.block_allocator import blocks_for
from tandem.engine.demo_model import make_tiny_checkpoint
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

BLOCK = 4
SYSTEM = ("A serving system answers many requests at once: it reads the prompt, computes the keys and values "
          "of every token, and then writes one new token at a time until the answer is complete. ")
QUESTIONS = ["What is the capital of France?", "Hello world! How are you today?", "What is the capital of France?"]
MAX_TOKENS = 16


def _wait_registered(cluster: LocalCluster, role: str, worker_ids: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(cluster.worker(role, w) for w in worker_ids):
            return
        time.sleep(0.1)
    raise AssertionError(f"{worker_ids} did not register; logs:\n{cluster.logs()}")


@pytest.fixture(scope="module")
def caching_cluster(tiny_llama, tmp_path_factory):
    c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp("logs-prefix")), tokens_per_block=BLOCK,
                     max_num_tokens=16, max_seq_len=256, max_input_len=200, enable_prefix_caching=True)
    c.start_service("prefill", "prefill-1")  # two prefill workers: the prefix must pick one
    c.start()
    _wait_registered(c, "prefill", ["prefill-0", "prefill-1"])
    yield c
    c.stop()


def _expected_cached(ids: list[int], earlier: list[list[int]]) -> int:
    """Full blocks shared with an earlier prompt, never the block of the last token."""
    best = 0
    for other in earlier:
        common = 0
        while common < min(len(ids), len(other)) and ids[common] == other[common]:
            common += 1
        best = max(best, min(common // BLOCK, (len(ids) - 1) // BLOCK) * BLOCK)
    return best


def test_shared_prompt_prefix_is_reused_with_unchanged_output(caching_cluster, hf_greedy, tiny_llama):
    cluster = caching_cluster
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = cluster.settings.model_name
    seen: list[list[int]] = []
    with httpx.Client(base_url=cluster.base_url, timeout=120) as http:
        for question in QUESTIONS:
            body = {"model": model, "prompt": SYSTEM + question, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "return_token_ids": True}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            ids = tokenizer(SYSTEM + question).input_ids
            assert out["choices"][0]["token_ids"] == hf_greedy(ids, MAX_TOKENS)
            cached = out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert cached == _expected_cached(ids, seen), question
            seen.append(ids)
    assert _expected_cached(seen[1], seen[:1]) >= 8 * BLOCK  # the system prompt spans many blocks
    # every request went to the prefill worker that held the prefix: only one has cached anything
    sizes = sorted(cluster.redis.scard(f"tandem:prefix:{w}") for w in ("prefill-0", "prefill-1"))
    assert sizes[0] == 0 and sizes[1] > 0


def test_streaming_usage_reports_cached_tokens(caching_cluster, hf_greedy, tiny_llama):
    cluster = caching_cluster
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    prompt = SYSTEM + "Please write a short story about a robot who learns to paint."
    stream = client.completions.create(model=cluster.settings.model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    token_ids, usage = [], None
    for chunk in stream:
        if chunk.choices:
            token_ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        usage = chunk.usage or usage
    ids = tokenizer(prompt).input_ids
    assert token_ids == hf_greedy(ids, MAX_TOKENS)
    assert usage.prompt_tokens == len(ids)
    assert usage.prompt_tokens_details.cached_tokens >= 8 * BLOCK
    cluster.wait_blocks_free("decode", "decode-0")
    for worker_id in ("prefill-0", "prefill-1"):  # cached blocks nobody holds count as free
        cluster.wait_blocks_free("prefill", worker_id)


# ---- sliding window --------------------------------------------------------------------------

WINDOW_PROMPT = ("Once upon a time there was a small model that lived in a test directory. It had two layers, four "
                 "heads and a tiny vocabulary, but it could still count: one, two, three, four, five, six, seven, "
                 "eight, nine, ten.")
WINDOW_MAX_TOKENS = 120


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-mistral"), "mistral")  # sliding_window 24


@pytest.fixture(scope="module")
def window_cluster(tiny_mistral, tmp_path_factory):
    c = LocalCluster(tiny_mistral, str(tmp_path_factory.mktemp("logs-window")), tokens_per_block=BLOCK,
                     max_num_tokens=16, max_seq_len=512, max_input_len=200, enable_prefix_caching=True)
    yield c.start()
    c.stop()


def _stream_sampling_decode_usage(cluster: LocalCluster, body: dict) -> tuple[list[int], list[int]]:
    """Stream a completion; -> (token ids, decode-worker blocks in use, sampled while it decoded)."""
    token_ids, used = [], []
    with httpx.Client(base_url=cluster.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[len("data: "):])["choices"]
                token_ids += (choices[0].get("token_ids") or []) if choices else []
                info = cluster.worker("decode", "decode-0")
                if info is not None and info.num_running == 1:
                    used.append(info.num_total_blocks - info.num_free_blocks)
    return token_ids, used


def test_mistral_past_its_window_matches_hf_with_bounded_decode_blocks(window_cluster, tiny_mistral):
    cluster = window_cluster
    tokenizer = AutoTokenizer.from_pretrained(tiny_mistral)
    ids = tokenizer(WINDOW_PROMPT).input_ids
    hf = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32).eval()
    assert hf.config.sliding_window == 24 and len(ids) > 2 * 24
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=WINDOW_MAX_TOKENS, do_sample=False,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    assert len(expected) == WINDOW_MAX_TOKENS  # no early EOS: the output runs 5 windows past the prompt

    body = {"model": cluster.settings.model_name, "prompt": WINDOW_PROMPT, "max_tokens": WINDOW_MAX_TOKENS,
            "temperature": 0, "stream": True, "return_token_ids": True}
    token_ids, used = _stream_sampling_decode_usage(cluster, body)
    assert token_ids == expected

    # the request reserved its prompt's blocks (the transfer's destination), not prompt + max_tokens, and
    # once decoding holds a window's worth: ceil(23 / 4) + 1 blocks
    max_live = blocks_for(24 - 1, BLOCK) + 1
    assert used, "no decode-worker snapshot while the request was decoding"
    assert max(used) <= blocks_for(len(ids), BLOCK) < blocks_for(len(ids) + WINDOW_MAX_TOKENS, BLOCK)
    assert sorted(used)[len(used) // 2] <= max_live

    # the same prompt again: its prefix comes from the prefill worker's cache (blocks released out of the
    # window there stay cached) and the output does not change
    again = httpx.post(f"{cluster.base_url}/v1/completions", timeout=120,
                       json={**body, "stream": False, "max_tokens": 40}).json()
    assert again["choices"][0]["token_ids"] == expected[:40]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // BLOCK * BLOCK
    cluster.wait_blocks_free("decode", "decode-0")
    cluster.wait_blocks_free("prefill", "prefill-0")
