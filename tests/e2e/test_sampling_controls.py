"""End to end on the CPU: repetition_penalty, presence/frequency penalties, logit_bias and
min_p through the whole cluster (gateway, prefill worker for token 0, decode worker with
run-ahead steps after) equal HF transformers' generate() with the matching processors,
token for token, for concurrent requests that share decode steps with plain ones."""

import asyncio
import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from tests.engine.test_logits_process import OpenAIPenalties

pytestmark = pytest.mark.slow
LAYOUTS = ("separate", "colocated")  # each test runs against both (tests/e2e/conftest.py)

PROMPTS = [
    "Hello world!",
    "The quick brown fox",
    "Once upon a time there was a small model that lived in a test directory.",
    "one, two, three, four, five, six, seven, eight, nine, ten.",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def hf_processed(tiny_llama):
    """HF generate(do_sample=False) with HF's repetition_penalty and sequence_bias and OpenAI's
    presence/frequency rule as a logits processor."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], repetition_penalty: float = 1.0, logit_bias: dict | None = None,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> list[int]:
        kwargs = {}
        if repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = repetition_penalty
        if logit_bias:
            kwargs["sequence_bias"] = {(int(t),): b for t, b in logit_bias.items()}
        if frequency_penalty or presence_penalty:
            kwargs["logits_processor"] = LogitsProcessorList(
                [OpenAIPenalties(len(prompt_ids), frequency_penalty, presence_penalty)])
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, **kwargs)
        return out[0, len(prompt_ids):].tolist()

    return generate


async def _complete(base_url: str, model: str, prompt: str, stream: bool, **fields) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True, "stream": stream, **fields}
    async with httpx.AsyncClient(timeout=120) as client:
        if not stream:
            resp = await client.post(f"{base_url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["token_ids"]
        token_ids = []
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    token_ids += json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
        return token_ids


def _run(cluster, requests: list[tuple[str, dict]]) -> list[list[int]]:
    """Every (prompt, fields) at once (alternately streamed), so they share decode steps."""
    model = cluster.settings.model_name

    async def run_all():
        return await asyncio.gather(*[_complete(cluster.base_url, model, prompt, i % 2 == 1, **fields)
                                      for i, (prompt, fields) in enumerate(requests)])

    return asyncio.run(run_all())


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_penalties_equal_hf_generate_with_its_processors(cluster, hf_processed, tokenizer):
    cases = [{"repetition_penalty": 1.8}, {"frequency_penalty": 0.9, "presence_penalty": 0.7},
             {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.3}]
    requests = [(prompt, fields) for prompt in PROMPTS for fields in cases]
    requests += [(prompt, {}) for prompt in PROMPTS[:2]]  # plain rows in the same steps
    results = _run(cluster, requests)
    changed = 0
    for (prompt, fields), token_ids in zip(requests, results):
        ids = tokenizer(prompt).input_ids
        expected = hf_processed(ids, **fields)
        assert token_ids == expected, (prompt, fields)
        changed += expected != hf_processed(ids)
    assert changed >= len(PROMPTS) * len(cases) - 2  # the penalties did change the outputs
    cluster.wait_blocks_free("decode", "decode-0")
    cluster.wait_blocks_free("prefill", "prefill-0")


def test_logit_bias_equals_hf_sequence_bias(cluster, hf_processed, tokenizer):
    requests = []
    for prompt in PROMPTS:
        plain = hf_processed(tokenizer(prompt).input_ids)
        # ban what greedy picks first, favour a token it never picks
        bias = {str(plain[0]): -100.0, str(plain[2]): -50.0, "42": 1.5}
        requests.append((prompt, {"logit_bias": bias}))
    results = _run(cluster, requests + [(PROMPTS[0], {})])
    for (prompt, fields), token_ids in zip(requests, results):
        ids = tokenizer(prompt).input_ids
        expected = hf_processed(ids, logit_bias={int(t): b for t, b in fields["logit_bias"].items()})
        assert token_ids == expected, prompt
        assert expected != hf_processed(ids)
    assert results[-1] == hf_processed(tokenizer(PROMPTS[0]).input_ids)


def test_min_p_one_keeps_only_the_most_likely_token(cluster, hf_processed, tokenizer):
    """Sampling at temperature 1 with min_p 1 keeps the top token alone: greedy's output."""
    requests = [(prompt, {"temperature": 1.0, "min_p": 1.0, "seed": 3}) for prompt in PROMPTS[:2]]
    for (prompt, _), token_ids in zip(requests, _run(cluster, requests)):
        assert token_ids == hf_processed(tokenizer(prompt).input_ids), prompt
