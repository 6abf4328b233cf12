"""Prompt logprobs, echo, max_tokens 0 and best_of through the whole CPU cluster (gateway,
decode and prefill workers; prompts longer than the prefill's 16-token chunks): the prompt's
logprobs are HF transformers' log-softmax of a forward over the prompt."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

LAYOUTS = ("separate", "colocated")  # each test runs against both (tests/e2e/conftest.py)

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_llama):
    """prompt ids -> [P, V] log-softmax of HF's logits at each prompt position (row i: token i + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def score(prompt_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return score


def _complete(cluster, **body) -> dict:
    response = httpx.post(f"{cluster.base_url}/v1/completions", timeout=120, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_and_prompt_logprobs_are_hf_log_softmax_over_chunks(cluster, tokenizer, hf_prompt_logprobs):
    prompt_ids = tokenizer(PROMPT).input_ids
    assert len(prompt_ids) > 2 * cluster.settings.max_num_tokens  # three chunks and more
    expected = hf_prompt_logprobs(prompt_ids)
    body = _complete(cluster, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=3, prompt_logprobs=3,
                     ignore_eos=True)
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT)
    logprobs, ranked = choice["logprobs"], choice["prompt_logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None and ranked[0] is None
    assert len(logprobs["tokens"]) == len(prompt_ids) + 4 and len(ranked) == len(prompt_ids)
    for i in range(1, len(prompt_ids)):
        row, token_id = expected[i - 1], prompt_ids[i]
        assert abs(logprobs["token_logprobs"][i] - row[token_id].item()) < 1e-4
        values, ids = row.topk(3)
        entry, top_ids = ranked[i], ids.tolist()
        assert entry[str(token_id)]["rank"] == int((row > row[token_id]).sum()) + 1
        assert abs(entry[str(token_id)]["logprob"] - row[token_id].item()) < 1e-4
        assert {int(t) for t in entry} == set(top_ids) | {token_id}  # the prompt's token and HF's top 3
        for rank, (top_id, value) in enumerate(zip(top_ids, values.tolist()), 1):
            assert abs(entry[str(top_id)]["logprob"] - value) < 1e-4 and entry[str(top_id)]["rank"] == rank
        assert set(logprobs["top_logprobs"][i]) >= {tokenizer.decode([t]) for t in top_ids}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) and body["usage"]["completion_tokens"] == 4
    cluster.wait_blocks_free("decode", "decode-0")


def test_max_tokens_zero_echoes_the_scored_prompt_and_generates_nothing(cluster, tokenizer, hf_prompt_logprobs):
    prompt_ids = tokenizer(PROMPT).input_ids
    expected = hf_prompt_logprobs(prompt_ids)
    body = _complete(cluster, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(prompt_ids) and token_logprobs[0] is None
    assert all(abs(token_logprobs[i] - expected[i - 1, prompt_ids[i]].item()) < 1e-4 for i in range(1, len(prompt_ids)))
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 0,
                             "total_tokens": len(prompt_ids)}
    streamed = httpx.post(f"{cluster.base_url}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True}).text
    assert f'"text":"{PROMPT}"' in streamed and "data: [DONE]" in streamed
    # nothing decoded, and every block back on both sides
    cluster.wait_blocks_free("decode", "decode-0")
    cluster.wait_blocks_free("prefill", "prefill-0")


def test_the_openai_client_scores_a_prompt(cluster, tokenizer, hf_prompt_logprobs):
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    prompt_ids = tokenizer(PROMPT).input_ids
    expected = hf_prompt_logprobs(prompt_ids)
    completion = client.completions.create(model=cluster.settings.model_name, prompt=PROMPT, echo=True, logprobs=2,
                                           max_tokens=0)
    choice = completion.choices[0]
    assert choice.text == PROMPT and completion.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids]
    for i in range(1, len(prompt_ids)):
        assert abs(choice.logprobs.token_logprobs[i] - expected[i - 1, prompt_ids[i]].item()) < 1e-4
        assert len(choice.logprobs.top_logprobs[i]) >= 1
    cluster.wait_blocks_free("decode", "decode-0")


def test_best_of_returns_the_sequences_of_highest_cumulative_logprob(cluster):
    """best_of 4, n 2 with a seed: the 2 of the 4 seeded sequences (sequence i samples with
    seed + i, as choice i of n 4 does) whose sampled tokens' logprobs sum highest, best first."""
    common = dict(prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234, return_token_ids=True, ignore_eos=True)
    four = _complete(cluster, n=4, logprobs=0, **common)
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in four["choices"]]
    assert len({tuple(c["token_ids"]) for c in four["choices"]}) > 1  # sampled, not all alike
    best = sorted(range(4), key=lambda i: (-sums[i], i))[:2]
    body = _complete(cluster, n=2, best_of=4, **common)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [four["choices"][i]["token_ids"] for i in best]
    assert all(c["logprobs"] is None for c in body["choices"])  # not asked for
    assert body["usage"]["completion_tokens"] == 4 * 6  # every sequence sampled is billed
    with_logprobs = _complete(cluster, n=2, best_of=4, logprobs=0, **common)
    assert [sum(c["logprobs"]["token_logprobs"]) for c in with_logprobs["choices"]] == pytest.approx(
        [sums[i] for i in best], abs=1e-4)
    cluster.wait_blocks_free("decode", "decode-0")
