"""Echo, prompt logprobs, max_tokens 0 and best_of through the gateway, against a real
redis-server and a scripted decode worker: what a request asks for reaches the workers, and
the prompt logprobs the prefill worker's first event carries come back as OpenAI's legacy
logprobs (echo) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import httpx

from tandem.cluster.messages import TokenEvent
from tandem.gateway.choices import best_of, cumulative_logprob
from tandem.gateway.responses import ChoiceResult
from tests.gateway.conftest import parse_sse, post


def _prompt_entries(prompt_ids: list[int], k: int) -> list:
    """One entry per prompt token but the first: logprob -i/10, top k = (the token, 999 at -9), rank i."""
    return [None] + [[-i / 10, [[t, -i / 10], [999, -9.0]][:k], i] for i, t in enumerate(prompt_ids) if i]


def _script(token_ids, finish="length", logprob_of=lambda req, i: -(i + 1.0)):
    """One event per token; the first carries the prompt's entries when asked."""

    def script(req):
        k, pk = req.sampling.logprobs, req.sampling.prompt_logprobs
        prompt = None if pk is None else _prompt_entries(req.prompt_token_ids, pk)
        if req.max_tokens == 0:
            return [(0.0, TokenEvent(req.request_id, 0, [], "length", prompt_logprobs=prompt))]
        events = []
        for i, token_id in enumerate(token_ids):
            lp = logprob_of(req, i)
            entry = None if k is None else [lp, [[token_id, lp], [999, -9.0]][:k]]
            events.append((0.0, TokenEvent(req.request_id, i, [token_id], finish if i == len(token_ids) - 1 else None,
                                           logprobs=None if entry is None else [entry],
                                           prompt_logprobs=prompt if i == 0 else None)))
        return events

    return script


def test_echo_with_logprobs_leads_with_the_prompt(serve, fake_worker, tokenizer, text_ids):
    worker = fake_worker(_script(text_ids[:3]))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "logprobs": 1,
                                            "echo": True}).json()
    request = worker.requests[0]
    assert request.sampling.prompt_logprobs == 1 and request.sampling.logprobs == 1  # echo's prompt logprobs
    prompt_ids = request.prompt_token_ids
    choice = body["choices"][0]
    assert choice["text"] == "Hello there" + tokenizer.decode(text_ids[:3])
    logprobs = choice["logprobs"]
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids + text_ids[:3]]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == [None] + [-i / 10 for i in range(1, len(prompt_ids))] + [-1.0, -2.0, -3.0]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {texts[1]: -0.1}
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert logprobs["text_offset"] == offsets
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt_ids)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) and body["usage"]["completion_tokens"] == 3


def test_echo_without_logprobs_only_prepends_the_text(serve, fake_worker, tokenizer, text_ids):
    worker = fake_worker(_script(text_ids[:2]))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "echo": True}).json()
    assert worker.requests[0].sampling.prompt_logprobs is None
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode([5, 6, 7]) + tokenizer.decode(text_ids[:2])
    assert choice["logprobs"] is None and "prompt_logprobs" not in choice


def test_vllm_prompt_logprobs_on_the_choice_and_for_chat_at_the_top(serve, fake_worker, tokenizer, text_ids):
    worker = fake_worker(_script(text_ids[:2]))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 2, "prompt_logprobs": 2}).json()
    prompt_ids = worker.requests[0].prompt_token_ids
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(text_ids[:2]) and choice["logprobs"] is None
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt_ids)
    assert got[1] == {str(prompt_ids[1]): {"logprob": -0.1, "rank": 1,
                                           "decoded_token": tokenizer.decode([prompt_ids[1]])},
                      "999": {"logprob": -9.0, "rank": 2, "decoded_token": tokenizer.decode([999])}}
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "prompt_logprobs": 0}).json()
    chat_prompt = worker.requests[1].prompt_token_ids
    assert "prompt_logprobs" not in chat["choices"][0]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat_prompt)
    assert all(list(d) == [str(t)] for d, t in zip(chat["prompt_logprobs"][1:], chat_prompt[1:]))


def test_max_tokens_zero_returns_the_prompt_scored(serve, fake_worker, tokenizer):
    worker = fake_worker(_script([]))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 0, "echo": True,
                                            "logprobs": 0}).json()
    request = worker.requests[0]
    assert request.max_tokens == 0 and request.sampling.prompt_logprobs == 0
    choice = body["choices"][0]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None] + [-i / 10 for i in range(1, len(request.prompt_token_ids))]
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert body["usage"] == {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": 0,
                             "total_tokens": len(request.prompt_token_ids)}
    # with prompt_logprobs alone too; and never without something to score
    scored = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 0, "prompt_logprobs": 1}).json()
    assert scored["choices"][0]["text"] == "" and scored["choices"][0]["prompt_logprobs"][0] is None
    refused = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert len(worker.requests) == 2


def test_streamed_echo_sends_the_prompt_first(serve, fake_worker, tokenizer, text_ids):
    worker = fake_worker(_script(text_ids[:3]))
    server = serve()
    response = post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "logprobs": 0,
                                                "echo": True, "stream": True})
    prompt_ids = worker.requests[0].prompt_token_ids
    chunks = [c for c in parse_sse(response.text) if c != "[DONE]"]
    assert chunks[0]["choices"][0]["text"].startswith("Hello there")
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello there" + tokenizer.decode(text_ids[:3])
    tokens, offsets, token_logprobs = [], [], []
    for c in chunks:
        if c["choices"][0]["logprobs"]:
            tokens += c["choices"][0]["logprobs"]["tokens"]
            offsets += c["choices"][0]["logprobs"]["text_offset"]
            token_logprobs += c["choices"][0]["logprobs"]["token_logprobs"]
    assert len(tokens) == len(prompt_ids) + 3 and token_logprobs[0] is None
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # one running offset
    assert chunks[0]["choices"][0]["prompt_logprobs"][0] is None
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])


def test_streamed_max_tokens_zero_is_one_chunk(serve, fake_worker):
    fake_worker(_script([]))
    server = serve()
    response = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 0, "echo": True, "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = parse_sse(response.text)
    assert events[0]["choices"][0]["text"] == "Hello" and events[0]["choices"][0]["finish_reason"] == "length"
    assert events[1]["usage"]["completion_tokens"] == 0 and events[-1] == "[DONE]" and len(events) == 3


def test_best_of_returns_the_highest_cumulative_logprobs(serve, fake_worker, tokenizer, text_ids):
    # sequence i's tokens have logprob -(i % 3 + 1) each: sequences 0 and 3 are the best, then 1
    worker = fake_worker(_script(text_ids[:2], logprob_of=lambda req, _: -(int(req.request_id.rsplit("-", 1)[1]) % 3 + 1.0)))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 4,
                                            "seed": 7}).json()
    assert sorted(r.request_id.rsplit("-", 1)[1] for r in worker.requests) == ["0", "1", "2", "3"]
    assert all(r.sampling.logprobs == 0 for r in worker.requests)  # asked for internally, to rank them
    assert sorted(r.sampling.seed for r in worker.requests) == [7, 8, 9, 10]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # the client did not ask
    assert body["usage"]["completion_tokens"] == 8  # every sequence sampled is billed
    with_logprobs = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 3,
                                                     "logprobs": 1}).json()
    assert [c["logprobs"]["token_logprobs"] for c in with_logprobs["choices"]] == [[-1.0, -1.0], [-2.0, -2.0]]
    assert all(r.sampling.logprobs == 1 for r in worker.requests[4:])


def test_best_of_ranks_by_the_sum_and_breaks_ties_by_index():
    def result(*logprobs):
        return ChoiceResult("", [], "length", [None if lp is None else [lp, []] for lp in logprobs])

    choices = [result(-1.0, -3.0), result(-0.5, -0.5), result(-2.0), result(-1.0), result(-4.0, None)]
    assert best_of(choices, 3) == [choices[1], choices[3], choices[2]]
    assert cumulative_logprob(choices[4]) == -4.0


def test_best_of_cannot_stream_more_than_n(serve, fake_worker, text_ids):
    worker = fake_worker(_script(text_ids[:2]))
    server = serve()
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "best_of": 2, "stream": True})
    assert response.status_code == 400 and not worker.requests


def test_a_resumable_echo_stream_replays_the_prompt(serve, fake_worker, tokenizer, text_ids):
    fake_worker(_script(text_ids[:3]))
    server = serve()
    response = post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "echo": True,
                                                "prompt_logprobs": 1, "stream": True,
                                                "stream_options": {"resumable": True}})
    request_id = response.headers["x-request-id"]
    live = [c for c in parse_sse(response.text) if c != "[DONE]"]
    replayed = [c for c in parse_sse(httpx.get(f"{server.url}/v1/streams/{request_id}", timeout=20).text)
                if c != "[DONE]"]
    assert replayed == live
    assert "".join(c["choices"][0]["text"] for c in live) == "Hello there" + tokenizer.decode(text_ids[:3])
    assert live[0]["choices"][0]["prompt_logprobs"][0] is None
