"""Multi-LoRA serving through the whole cluster equals HF transformers + PEFT, token for token.

Three PEFT adapters of different ranks (4, 8 with rsLoRA on every linear module, 16 on q, v and
down) and the base model, mixed in 8 concurrent streams of completions and chat, through each
layout (disaggregated prefill and decode workers, and one worker running both). The workers hold
two adapters in device slots and two in host memory, so the third adapter waits for a slot (the
schedulers admit at most two adapters at once), and adapters are evicted and read again from
their directories (their digest checked) while the others run. Then a decode worker is killed
while it streams an adapter's request: the stream continues on the other decode worker with
the same adapter and still equals PEFT's greedy tokens.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from tests.e2e.cluster import LAYOUTS, LocalCluster
from tests.e2e.serve_cluster import Stream
from tests.engine.lora_testing import make_peft_adapter, peft_greedy_generator

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
# name -> (r, lora_alpha, target_modules, more LoraConfig options)
ADAPTERS = {
    "ada-r4": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {}),
    "ada-r8": (8, 16, "all-linear", {"use_rslora": True}),
    "ada-r16": (16, 32, ["q_proj", "v_proj", "down_proj"], {}),
}
PROMPTS = [
    "The history of the river begins in the mountains, where",
    "Three things every engineer should know about caches:",
    "Once upon a time, in a city of glass towers,",
    "A short list of prime numbers: two, three, five,",
]
CHATS = ["What is the capital of France?", "Name a colour of the sky.", "Count to five.", "Say hello politely."]
# 8 concurrent streams: (kind, adapter or None for the base model, text)
STREAMS = ([("completion", name, p) for name, p in zip([*ADAPTERS, None], PROMPTS)]
           + [("chat", name, c) for name, c in zip([None, *ADAPTERS], CHATS)])


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(tiny_llama, root / name, r, alpha, targets, seed=i, **options)
            for i, (name, (r, alpha, targets, options)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def peft_greedy(tiny_llama, adapters):
    """PeftModel over the same base weights, fp32 on the CPU: (adapter or None, prompt ids, n) -> tokens."""
    return peft_greedy_generator(tiny_llama, adapters)


def _lora_settings(adapters: dict[str, str]) -> dict:
    return dict(enable_lora=True, lora_modules=[f"{name}={path}" for name, path in adapters.items()],
                max_loras=2, max_cpu_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module", params=LAYOUTS)
def lora_cluster(request, tiny_llama, adapters, tmp_path_factory):
    c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp(f"logs-{request.param}")), request.param,
                     tokens_per_block=4, max_num_tokens=16, max_seq_len=256, max_input_len=200,
                     decode_run_ahead="on", enable_prefix_caching=request.param == "separate",
                     **_lora_settings(adapters)).start()
    yield c
    c.stop()


def _expected(tokenizer, peft_greedy, kind: str, adapter: str | None, text: str) -> list[int]:
    if kind == "completion":
        ids = tokenizer(text).input_ids
    else:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False).input_ids
    return peft_greedy(adapter, ids, MAX_TOKENS)


async def _serve_all(cluster: LocalCluster) -> list[dict]:
    base = cluster.settings.model_name

    async def one(client, kind, adapter, text):
        body = {"model": adapter or base, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
        if kind == "completion":
            resp = await client.post("/v1/completions", json={**body, "prompt": text})
        else:
            resp = await client.post("/v1/chat/completions",
                                     json={**body, "messages": [{"role": "user", "content": text}]})
        assert resp.status_code == 200, resp.text
        return resp.json()

    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
        return await asyncio.gather(*(one(client, *stream) for stream in STREAMS))


def _token_ids(kind: str, answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def test_adapters_and_the_base_model_mixed_equal_peft(lora_cluster, tiny_llama, peft_greedy):
    cluster = lora_cluster
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    answers = asyncio.run(_serve_all(cluster))
    outputs = {}
    for (kind, adapter, text), answer in zip(STREAMS, answers):
        assert answer["model"] == (adapter or cluster.settings.model_name)
        expected = _expected(tokenizer, peft_greedy, kind, adapter, text)
        got = _token_ids(kind, answer)
        assert got == expected, f"{kind} with {adapter}: {got} != {expected}"
        outputs[(kind, adapter)] = got
    # the adapters really change the output: no two of the four models answer the first prompt alike
    firsts = [outputs[("completion", a)] for a in [*ADAPTERS, None]]
    assert len({tuple(t) for t in firsts}) == 4, firsts


def test_the_same_prompt_under_each_adapter_keeps_its_own_kv(lora_cluster, tiny_llama, peft_greedy):
    """With prefix caching, a prompt computed under one adapter is cached under that adapter only:
    the same prompt under the next adapter (or the base model) gets none of its KV, and the same
    prompt under the same adapter again reuses it."""
    cluster = lora_cluster
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = "Cached prefixes, one adapter at a time: " + PROMPTS[1] + " " + PROMPTS[2]
    expected = {a: peft_greedy(a, tokenizer(prompt).input_ids, MAX_TOKENS) for a in [*ADAPTERS, None]}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        for attempt in range(2):
            for adapter in [*ADAPTERS, None]:
                resp = client.post("/v1/completions", json={
                    "model": adapter or cluster.settings.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "return_token_ids": True})
                assert resp.status_code == 200, resp.text
                answer = resp.json()
                assert answer["choices"][0]["token_ids"] == expected[adapter], (attempt, adapter)
                cached = answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                if cluster.layout == "separate":  # (the colocated worker keeps no prefix cache)
                    assert (cached > 0) == (attempt == 1), (attempt, adapter, cached)


def test_a_killed_decode_worker_s_adapter_stream_continues(tiny_llama, adapters, peft_greedy, tmp_path):
    max_tokens = 200
    prompt = "The decode worker that holds this adapter's request will be killed while it streams"
    cluster = LocalCluster(tiny_llama, str(tmp_path), tokens_per_block=4, max_num_tokens=64, max_seq_len=512,
                           **_lora_settings(adapters))
    try:
        cluster.start_two_decode()
        client = Stream(cluster.base_url, "ada-r8", prompt, max_tokens, ignore_eos=True)
        client.start()
        victim = cluster.kill_busy_worker("decode", lambda: len(client.arrivals) > 5)
        assert victim is not None, f"the request never ran: {client.error}\n{cluster.logs()}"
        tokens_at_kill = len(client.token_ids)
        client.join(120)
        assert not client.is_alive()
        assert client.status == 200 and client.done and client.error is None, client.error
        assert 0 < tokens_at_kill < max_tokens, "killed after the request had finished: the test proves nothing"
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        assert client.token_ids == peft_greedy("ada-r8", tokenizer(prompt).input_ids, max_tokens,
                                                  ignore_eos=True)
    finally:
        cluster.stop()
