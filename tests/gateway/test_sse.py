"""OpenAI chunk shapes and SSE framing, without a server."""

from __future__ import annotations

import asyncio
import json

from tandem.gateway.errors import WorkerLost
from tandem.gateway.responses import DONE, ChoiceResult, Delta, ResponseFormat, Usage, sse, sse_events


def collect(fmt, deltas, usage=Usage(3, 2), include_usage=False, fail=None, num_choices=1):
    """``deltas``: Delta (choice 0) or (choice index, Delta)."""
    async def gen():
        for d in deltas:
            yield d if isinstance(d, tuple) else (0, d)
        if fail is not None:
            raise fail

    async def run():
        return [chunk async for chunk in sse_events(fmt, gen(), lambda: usage, include_usage,
                                                    num_choices=num_choices)]

    return asyncio.run(run())


def payloads(chunks):
    out = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        data = chunk[6:-2].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sse_frame_is_compact_utf8_json():
    assert sse({"text": "ü ☃"}) == 'data: {"text":"ü ☃"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def test_completion_stream_shape_and_usage():
    fmt = ResponseFormat("cmpl-1", 123, "tiny", chat=False)
    chunks = payloads(collect(fmt, [Delta("Hel", [1]), Delta("", [2]), Delta("lo", [3], "length")],
                              include_usage=True))
    assert chunks[-1] == "[DONE]"
    first, last, usage = chunks[0], chunks[1], chunks[2]
    assert first == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "tiny",
                     "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}]}
    assert last["choices"][0] == {"index": 0, "text": "lo", "logprobs": None, "finish_reason": "length"}
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                         "total_tokens": 5}
    assert len(chunks) == 4  # the empty, unfinished delta was not sent


def test_chat_stream_opens_with_role_and_ends_with_empty_delta():
    fmt = ResponseFormat("chatcmpl-1", 5, "tiny", chat=True)
    chunks = payloads(collect(fmt, [Delta("Hi", [7]), Delta("", [2], "stop")]))
    assert [c["object"] for c in chunks[:-1]] == ["chat.completion.chunk"] * 3
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hi"}
    assert chunks[2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[3] == "[DONE]"


def test_error_after_start_goes_in_the_stream():
    fmt = ResponseFormat("cmpl-1", 5, "tiny", chat=False)
    chunks = payloads(collect(fmt, [Delta("a", [1])], fail=WorkerLost("worker gone"), include_usage=True))
    assert chunks[1]["choices"][0]["finish_reason"] == "error"
    assert chunks[2] == {"error": {"message": "worker gone", "type": "service_unavailable", "param": None,
                                   "code": "worker_lost"}}
    assert chunks[3] == "[DONE]"


def test_token_ids_extension():
    fmt = ResponseFormat("cmpl-1", 5, "tiny", chat=False, return_token_ids=True, prompts=[[4, 5]])
    chunks = payloads(collect(fmt, [Delta("", [1]), Delta("x", [2], "stop")]))
    assert chunks[0]["choices"][0]["token_ids"] == [1] and chunks[0]["choices"][0]["prompt_token_ids"] == [4, 5]
    assert chunks[1]["choices"][0]["token_ids"] == [2] and "prompt_token_ids" not in chunks[1]["choices"][0]
    body = fmt.completion([ChoiceResult("x", [1, 2], "stop")], Usage(2, 2, cached_tokens=1))
    assert body["choices"][0]["token_ids"] == [1, 2] and body["choices"][0]["prompt_token_ids"] == [4, 5]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_non_streaming_bodies():
    usage = Usage(4, 1)
    text = ResponseFormat("cmpl-1", 5, "tiny", chat=False).completion([ChoiceResult("hi", [3], "stop")], usage)
    assert text == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "tiny",
                    "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    chat = ResponseFormat("chatcmpl-1", 5, "tiny", chat=True, return_token_ids=True,
                          prompts=[[9]]).completion([ChoiceResult("hi", [3], "length")], usage)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["prompt_token_ids"] == [9] and chat["choices"][0]["token_ids"] == [3]
    assert "prompt_tokens_details" not in chat["usage"]


def test_choices_stream_by_index():
    """n > 1: every chat choice opens with its role chunk; chunks carry their choice's index, and
    each completions choice's first chunk has the prompt token ids."""
    chat = payloads(collect(ResponseFormat("chatcmpl-1", 5, "tiny", chat=True),
                            [(1, Delta("b", [8])), (0, Delta("a", [7], "stop")), (1, Delta("", [2], "length"))],
                            num_choices=2))
    assert [c["choices"][0]["index"] for c in chat[:-1]] == [0, 1, 1, 0, 1]
    assert [c["choices"][0]["delta"] for c in chat[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert chat[2]["choices"][0]["delta"] == {"content": "b"} and chat[3]["choices"][0]["delta"] == {"content": "a"}
    fmt = ResponseFormat("cmpl-1", 5, "tiny", chat=False, return_token_ids=True, prompts=[[4]],
                         choices_per_prompt=2)
    text = payloads(collect(fmt, [(1, Delta("b", [8])), (0, Delta("a", [7])), (1, Delta("c", [9], "length")),
                                  (0, Delta("", [2], "stop"))], num_choices=2))
    assert [("prompt_token_ids" in c["choices"][0], c["choices"][0]["index"]) for c in text[:-1]] == \
        [(True, 1), (True, 0), (False, 1), (False, 0)]
    body = fmt.completion([ChoiceResult("a", [7, 2], "stop"), ChoiceResult("bc", [8, 9], "length")], Usage(1, 4))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "a", "stop"), (1, "bc", "length")]


def test_logprobs_objects_of_both_endpoints():
    """Completions: tokens, token_logprobs, top_logprobs (the top k and the sampled token) and
    text offsets that continue across chunks; chat: content items with bytes and top_logprobs."""
    texts = {1: "He", 2: "llo", 3: "!", 9: "x"}
    entries = [[-0.5, [[1, -0.5], [9, -1.5]]], [-2.0, [[9, -0.1], [3, -1.0]]]]  # token 2 is not in its top 2
    fmt = ResponseFormat("cmpl-1", 5, "tiny", chat=False, token_text=texts.__getitem__)
    chunks = payloads(collect(fmt, [Delta("He", [1], logprobs=entries[:1]), Delta("", [2], logprobs=entries[1:]),
                                    Delta("llo", [], "length", logprobs=[])]))
    first, second = chunks[0]["choices"][0]["logprobs"], chunks[1]["choices"][0]["logprobs"]
    assert first == {"tokens": ["He"], "token_logprobs": [-0.5], "top_logprobs": [{"He": -0.5, "x": -1.5}],
                     "text_offset": [0]}
    assert second == {"tokens": ["llo"], "token_logprobs": [-2.0],
                      "top_logprobs": [{"x": -0.1, "!": -1.0, "llo": -2.0}], "text_offset": [2]}
    assert chunks[1]["choices"][0]["text"] == ""  # text held back, its token's logprobs still sent
    chat = ResponseFormat("chatcmpl-1", 5, "tiny", chat=True, token_text=texts.__getitem__)
    body = chat.completion([ChoiceResult("Hello", [1, 2], "stop", entries)], Usage(1, 2))
    (item0, item1) = body["choices"][0]["logprobs"]["content"]
    assert item0 == {"token": "He", "logprob": -0.5, "bytes": [72, 101],
                     "top_logprobs": [{"token": "He", "logprob": -0.5, "bytes": [72, 101]},
                                      {"token": "x", "logprob": -1.5, "bytes": [120]}]}
    assert item1["token"] == "llo" and [t["token"] for t in item1["top_logprobs"]] == ["x", "!"]
    assert chat.completion([ChoiceResult("Hello", [1, 2], "stop")], Usage(1, 2))["choices"][0]["logprobs"] is None


def test_an_error_ends_every_choice_not_yet_ended():
    fmt = ResponseFormat("cmpl-1", 5, "tiny", chat=False)
    chunks = payloads(collect(fmt, [(1, Delta("a", [1], "length")), (0, Delta("b", [2]))], num_choices=3,
                              fail=WorkerLost("worker gone")))
    errors = [c["choices"][0]["index"] for c in chunks if isinstance(c, dict) and c.get("choices")
              and c["choices"][0]["finish_reason"] == "error"]
    assert errors == [0, 2] and chunks[-2]["error"]["code"] == "worker_lost"
