"""Logprobs through the gateway, against a real redis-server and a scripted decode worker:
what a request asks for reaches the workers as SamplingParams.logprobs, and the entries the
workers put on their events come back as OpenAI's logprobs objects, streamed and not."""

from __future__ import annotations

from tandem.cluster.messages import TokenEvent
from tests.gateway.conftest import parse_sse, post


def _script(token_ids, finish="length"):
    """One event per token, each with an entry: logprob -(i + 1), top 2 = (the token, 999)."""

    def script(req):
        k = req.sampling.logprobs
        events = []
        for i, token_id in enumerate(token_ids):
            entry = None if k is None else [-(i + 1.0), [[token_id, -(i + 1.0)], [999, -9.0]][:k]]
            events.append((0.0, TokenEvent(req.request_id, i, [token_id], finish if i == len(token_ids) - 1 else None,
                                           logprobs=None if entry is None else [entry])))
        return events

    return script


def test_completion_logprobs_non_streaming(serve, fake_worker, tokenizer, text_ids):
    worker = fake_worker(_script(text_ids[:3]))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2}).json()
    assert worker.requests[0].sampling.logprobs == 2
    logprobs = body["choices"][0]["logprobs"]
    texts = [tokenizer.decode([t]) for t in text_ids[:3]]
    assert logprobs["tokens"] == texts and logprobs["token_logprobs"] == [-1.0, -2.0, -3.0]
    assert logprobs["top_logprobs"][0] == {texts[0]: -1.0, tokenizer.decode([999]): -9.0}
    assert logprobs["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    plain = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).json()
    assert plain["choices"][0]["logprobs"] is None and worker.requests[1].sampling.logprobs is None


def test_chat_logprobs_streamed_per_token(serve, fake_worker, tokenizer, text_ids):
    worker = fake_worker(_script(text_ids[:4]))
    server = serve()
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4, "logprobs": True, "top_logprobs": 1,
                                                     "stream": True})
    assert worker.requests[0].sampling.logprobs == 1
    chunks = [c for c in parse_sse(response.text)[1:-1]]  # past the role chunk
    items = [item for c in chunks if c["choices"][0]["logprobs"] for item in c["choices"][0]["logprobs"]["content"]]
    assert [i["token"] for i in items] == [tokenizer.decode([t]) for t in text_ids[:4]]
    assert [i["logprob"] for i in items] == [-1.0, -2.0, -3.0, -4.0]
    assert all(len(i["top_logprobs"]) == 1 and i["top_logprobs"][0]["token"] == i["token"] for i in items)
    assert all(i["bytes"] == list(i["token"].encode()) for i in items)
    # logprobs true, no top_logprobs: the sampled tokens only
    post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                          "logprobs": True})
    assert worker.requests[1].sampling.logprobs == 0
