"""End to end on the CPU: real redis-server, gateway, prefill and decode processes.

Greedy output through the whole disaggregated path must equal HF transformers'
generate() token for token, for concurrent streaming clients (the official
openai client and raw httpx SSE), prompts longer than a chunk and a block.
"""

import asyncio
import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow
LAYOUTS = ("separate", "colocated")  # each test runs against both (tests/e2e/conftest.py)

PROMPTS = [
    "Hello world!",
    "The quick brown fox",
    "Once upon a time there was a small model that lived in a test directory.",
    "What is the capital of France?",
    "A serving system answers many requests at once: it reads the prompt, computes the keys and values "
    "of every token, and then writes one new token at a time until the answer is complete.",
    "one, two, three, four, five, six, seven, eight, nine, ten.",
    "Please write a short story about a robot who learns to paint.",
    "The weather is nice and the sun is shining; the children are playing in the park.",
]
MAX_TOKENS = 24


async def _openai_stream(base_url, model, prompt):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        extra_body={"return_token_ids": True},
    )
    text, token_ids, finish = "", [], None
    async for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        token_ids += (choice.model_extra or {}).get("token_ids") or []
        finish = choice.finish_reason or finish
    await client.close()
    return text, token_ids, finish


async def _httpx_stream(base_url, model, prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    text, token_ids, finish, done = "", [], None, False
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if not line or line.startswith("id: "):
                    continue
                assert line.startswith("data: ")
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    continue
                choice = json.loads(payload)["choices"][0]
                text += choice["text"]
                token_ids += choice.get("token_ids") or []
                finish = choice["finish_reason"] or finish
    assert done
    return text, token_ids, finish


def test_concurrent_streams_match_hf_generate(cluster, hf_greedy, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = cluster.settings.model_name

    async def run_all():
        calls = [(_openai_stream if i % 2 == 0 else _httpx_stream)(cluster.base_url, model, p)
                 for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*calls)

    results = asyncio.run(run_all())
    lengths = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert max(lengths) > 2 * cluster.settings.max_num_tokens  # several chunks
    assert min(lengths) < cluster.settings.tokens_per_block * 2
    for prompt, (text, token_ids, finish) in zip(PROMPTS, results):
        expected = hf_greedy(tokenizer(prompt).input_ids, MAX_TOKENS)
        assert token_ids == expected, prompt
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
        assert finish == ("length" if len(expected) == MAX_TOKENS else "stop")
    cluster.wait_blocks_free("decode", "decode-0")
    cluster.wait_blocks_free("prefill", "prefill-0")
    if cluster.layout == "colocated":  # prompt chunks and decode rows did share steps
        assert cluster.worker("decode", "decode-0").num_mixed_steps > 0


def test_non_streaming_and_chat(cluster, hf_greedy, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    model = cluster.settings.model_name
    assert [m.id for m in client.models.list().data] == [model]

    completion = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    expected = hf_greedy(tokenizer(PROMPTS[2]).input_ids, MAX_TOKENS)
    assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert completion.usage.completion_tokens == len(expected)
    assert completion.usage.prompt_tokens == len(tokenizer(PROMPTS[2]).input_ids)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False).input_ids
    expected = hf_greedy(chat_ids, MAX_TOKENS)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        if c.choices
    )
    assert streamed == chat.choices[0].message.content


def test_the_responses_api_answers_as_hf_generate(cluster, hf_greedy, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False).input_ids
    expected = tokenizer.decode(hf_greedy(chat_ids, MAX_TOKENS), skip_special_tokens=True)
    kwargs = dict(model=cluster.settings.model_name, instructions="Be brief.", input=messages[1]["content"],
                  max_output_tokens=MAX_TOKENS, temperature=0)
    assert client.responses.create(**kwargs).output_text == expected
    streamed = "".join(e.delta for e in client.responses.create(stream=True, **kwargs)
                       if e.type == "response.output_text.delta")
    assert streamed == expected


def test_seeded_sampling_is_reproducible(cluster):
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    kwargs = dict(model=cluster.settings.model_name, prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                  top_p=0.9, seed=1234, extra_body={"top_k": 50, "ignore_eos": True})
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second
    # n choices: choice i samples as a single request seeded seed + i would
    choices = client.completions.create(n=3, **kwargs).choices
    assert [c.index for c in choices] == [0, 1, 2] and choices[0].text == first
    for i in (1, 2):
        alone = client.completions.create(**{**kwargs, "seed": 1234 + i}).choices[0].text
        assert choices[i].text == alone
    assert len({c.text for c in choices}) > 1


def test_n_greedy_choices_each_match_hf_generate(cluster, hf_greedy, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    completion = client.completions.create(model=cluster.settings.model_name, prompt=PROMPTS[3], n=2,
                                           max_tokens=MAX_TOKENS, temperature=0)
    expected = tokenizer.decode(hf_greedy(tokenizer(PROMPTS[3]).input_ids, MAX_TOKENS), skip_special_tokens=True)
    assert [c.text for c in completion.choices] == [expected, expected]
    assert completion.usage.prompt_tokens == len(tokenizer(PROMPTS[3]).input_ids)
    cluster.wait_blocks_free("decode", "decode-0")


def test_a_batch_of_prompts_answers_each_as_hf_generate(cluster, hf_greedy, tiny_llama):
    """/v1/completions' prompt as a list (texts, or token-id lists): prompt p's choice i is choice
    p * n + i, each equal to HF greedy on its own prompt, streamed or not; echo and the token ids
    are each choice's own prompt's; usage counts each prompt once; best_of picks within a prompt."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    model = cluster.settings.model_name
    texts = [PROMPTS[0], PROMPTS[4], PROMPTS[6]]
    prompt_ids = [tokenizer(p).input_ids for p in texts]
    expected = [hf_greedy(ids, MAX_TOKENS) for ids in prompt_ids]
    for prompt in (texts, prompt_ids):
        completion = client.completions.create(model=model, prompt=prompt, n=2, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"return_token_ids": True})
        assert [c.index for c in completion.choices] == list(range(6))
        for c in completion.choices:
            assert c.model_extra["token_ids"] == expected[c.index // 2]
            assert c.model_extra["prompt_token_ids"] == prompt_ids[c.index // 2]
        assert completion.usage.prompt_tokens == sum(map(len, prompt_ids))
        assert completion.usage.completion_tokens == 2 * sum(map(len, expected))

    streamed: dict[int, list[int]] = {}
    finished = set()
    for chunk in client.completions.create(model=model, prompt=texts, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True}):
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens == sum(map(len, prompt_ids))
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
            if c.finish_reason is not None:
                finished.add(c.index)
    assert streamed == dict(enumerate(expected)) and finished == {0, 1, 2}

    echoed = client.completions.create(model=model, prompt=texts[:2], max_tokens=4, temperature=0, echo=True,
                                       extra_body={"prompt_logprobs": 0})
    for c in echoed.choices:
        assert c.text == texts[c.index] + tokenizer.decode(expected[c.index][:4], skip_special_tokens=True)
        scored = c.model_extra["prompt_logprobs"]
        assert scored[0] is None and [next(iter(e)) for e in scored[1:]] == list(map(str, prompt_ids[c.index][1:]))

    best = client.completions.create(model=model, prompt=texts[:2], best_of=3, max_tokens=6, temperature=1.0,
                                     seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 2 * 3 * 6
    cluster.wait_blocks_free("decode", "decode-0")


def test_logprobs_are_hf_log_softmax_of_each_step(cluster, hf_greedy_logprobs, tiny_llama):
    """Greedy, through prefill (token 0) and decode (the rest): each token's logprob and the top 3
    are HF's log-softmax of that step's raw logits."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt_ids = tokenizer(PROMPTS[4]).input_ids
    expected_ids, expected = hf_greedy_logprobs(prompt_ids, 8)
    body = httpx.post(f"{cluster.base_url}/v1/completions", timeout=120, json={
        "prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "logprobs": 3, "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["token_ids"] == expected_ids
    logprobs = choice["logprobs"]
    for step, token_id in enumerate(expected_ids):
        assert abs(logprobs["token_logprobs"][step] - expected[step, token_id].item()) < 1e-4
        values, ids = expected[step].topk(3)
        top = logprobs["top_logprobs"][step]
        for token_id_k, value in zip(ids.tolist(), values.tolist()):
            assert abs(top[tokenizer.decode([token_id_k])] - value) < 1e-4
    streamed = []
    with httpx.stream("POST", f"{cluster.base_url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "logprobs": True,
            "ignore_eos": True,
            "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                    streamed += chunk["choices"][0]["logprobs"]["content"]
    assert len(streamed) == 6 and all(item["logprob"] <= 0.0 and item["top_logprobs"] == [] for item in streamed)


def test_min_tokens_matches_hf_min_new_tokens(cluster, hf_greedy, tiny_llama):
    """Stop tokens that would be picked at token 0 (the prefill worker's) and at a later token
    below min_tokens (the decode worker's) wait for min_tokens, as HF's min_new_tokens holds off
    its eos ids; the tokens equal HF's."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt_ids = tokenizer(PROMPTS[5]).input_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]

    def hf(stop):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=12, min_new_tokens=4, do_sample=False,
                                 eos_token_id=stop + eos, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        return out[0, len(prompt_ids):].tolist()

    def unbanned_pick(prefix):
        with torch.inference_mode():
            return int(model(torch.tensor([prompt_ids + prefix])).logits[0, -1].argmax())

    stop = [hf_greedy(prompt_ids, 1)[0]]  # token 0's own pick
    for _ in range(8):  # add what would come at token 1 until some token 1-3 would pick a stop token
        expected = hf(stop)
        picks = [unbanned_pick(expected[:k]) for k in (1, 2, 3)]
        if any(p in stop for p in picks):
            break
        stop.append(picks[0])
    assert any(p in stop for p in picks), "no decode step of this prompt would pick a stop token"
    body = httpx.post(f"{cluster.base_url}/v1/completions", timeout=120, json={
        "prompt": prompt_ids, "max_tokens": 12, "min_tokens": 4, "stop_token_ids": stop, "temperature": 0,
        "return_token_ids": True}).json()
    assert body["choices"][0]["token_ids"] == expected and expected[0] != stop[0] and len(expected) >= 4


BAD_REQUESTS = [
    ({"model": "tiny", "prompt": "x" * 5000, "max_tokens": 4}, "prompt"),  # longer than max_input_len
    ({"prompt": "hello", "max_tokens": 10_000}, "max_tokens"),  # cannot fit max_seq_len
    ({"prompt": "hello", "max_tokens": "many"}, "max_tokens"),  # wrong type
    ({"prompt": "hello", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hello", "temperature": "hot"}, "temperature"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": [1, 2, 10_000_000]}, "prompt"),  # out-of-vocab token id
]


def test_bad_input_gets_openai_errors_and_cluster_keeps_serving(cluster):
    model = cluster.settings.model_name
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        for body, param in BAD_REQUESTS:
            body = {"model": model, **body} if "model" not in body else {**body, "model": model}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 400, (body, resp.text)
            error = resp.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error"
            assert error["message"]
        unknown = http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 2})
        assert unknown.status_code in (400, 404) and "error" in unknown.json()
        malformed = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert malformed.status_code == 400 and "error" in malformed.json()
        ok = http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    cluster.wait_blocks_free("decode", "decode-0")


def test_client_disconnect_releases_blocks(cluster):
    body = {"model": cluster.settings.model_name, "prompt": PROMPTS[4], "max_tokens": 190, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
        held = cluster.worker("decode", "decode-0")
    assert seen == 3
    info = cluster.wait_blocks_free("decode", "decode-0")
    assert info.num_free_blocks == info.num_total_blocks
    assert held is not None
