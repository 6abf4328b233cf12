"""What lets another gateway continue a stream, without a server: event ids, a stream of events
continued from the position retained with any of its events, and a TextStream caught up on the
tokens already sent."""

from __future__ import annotations

import asyncio

from tandem.cluster.sampling import SamplingParams
from tandem.gateway.responses import (
    DONE, Delta, ResponseFormat, StreamPosition, Usage, parse_event_id, sse_events, with_id, with_ids,
)
from tandem.gateway.text_stream import TextStream
from tandem.gateway.validation import GenerationInput


def test_event_ids():
    assert with_id(b'data: {"a":1}\n\n', "cmpl-1", 7) == b'data: {"a":1}\nid: cmpl-1.7\n\n'
    assert with_id(DONE, "cmpl-1", 8) == b"data: [DONE]\nid: cmpl-1.8\n\n"

    async def frames():
        for _ in range(3):
            yield b"data: x\n\n"

    async def run():
        return [f async for f in with_ids("r", frames())]

    assert asyncio.run(run()) == [b"data: x\nid: r.0\n\n", b"data: x\nid: r.1\n\n", b"data: x\nid: r.2\n\n"]
    assert parse_event_id("cmpl-1", "cmpl-1.12") == 12
    for bad in ["cmpl-1", "cmpl-1.", "cmpl-1.-1", "cmpl-1.1e3", "cmpl-2.1", "cmpl-1.1.2", "cmpl-1.١", "x" * 30]:
        assert parse_event_id("cmpl-1", bad) is None, bad


def _run(fmt, deltas, position=None, include_usage=True):
    """The frames of a stream over ``deltas``, and after each frame the retained position and how
    many deltas had been consumed."""
    consumed = [0]

    async def gen():
        for delta in deltas:
            consumed[0] += 1
            yield 0, delta

    async def run():
        out = []
        async for frame in sse_events(fmt, gen(), lambda: Usage(3, 4), include_usage, position=position):
            out.append((frame, StreamPosition.from_dict(_round_trip(position.to_dict())) if position else None,
                        consumed[0]))
        return out

    return asyncio.run(run())


def _round_trip(d):
    import json

    return json.loads(json.dumps(d))


def test_a_stream_continued_from_any_event_is_the_uninterrupted_stream():
    entries = [[-0.5, [[1, -0.5]]], [-1.0, [[2, -1.0]]], [-2.0, [[3, -2.0]]], [-0.1, [[4, -0.1]]]]
    texts = {1: "He", 2: "llo", 3: "!", 4: "?"}
    deltas = [Delta("He", [1], logprobs=entries[:1]), Delta("", [2], logprobs=entries[1:2]),
              Delta("llo!", [3], logprobs=entries[2:3]), Delta("", [], None), Delta("?", [4], "length", entries[3:])]
    for chat, token_ids in [(False, False), (True, False), (False, True)]:
        fmt = ResponseFormat("r", 1, "tiny", chat, return_token_ids=token_ids, prompts=[[9]],
                             token_text=texts.__getitem__)
        whole = _run(fmt, deltas, StreamPosition())
        frames = [f for f, _, _ in whole]
        # without token ids the empty delta sends nothing; the usage chunk, [DONE] and chat's role chunk do
        assert frames[-1] == DONE and len(frames) == len(deltas) - (not token_ids) + 2 + chat
        for k, (_frame, position, consumed) in enumerate(whole[:-1]):
            rest = _run(fmt, deltas[consumed:], position)
            assert frames[:k + 1] + [f for f, _, _ in rest] == frames, (chat, token_ids, k)


def test_a_finished_stream_continues_with_its_tail_only():
    fmt = ResponseFormat("r", 1, "tiny", False)
    position = StreamPosition(started={0}, finished={0})
    assert [f for f, _, _ in _run(fmt, [], position)] == [_run(fmt, [Delta("a", [1], "stop")])[1][0], DONE]
    position.usage_sent = True
    assert [f for f, _, _ in _run(fmt, [], position)] == [DONE]
    assert [f for f, _, _ in _run(fmt, [], StreamPosition(started={0}, finished={0}, failed=True))] == [DONE]


def test_a_caught_up_text_stream_goes_on_as_the_first_one_would(tokenizer):
    text = "Hello wörld! Say STOP? ☃ done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    inp = GenerationInput(prompt_token_ids=[5, 6], sampling=SamplingParams(min_tokens=2), max_tokens=100,
                          stop=["STOP?"], include_stop_str_in_output=True)
    batches = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    for split in range(len(batches) + 1):
        first = TextStream(tokenizer, inp)
        sent = [first.advance(batch, None) for batch in batches[:split]]
        if first.finish_reason is not None:
            break  # a finished choice is not continued
        later = [first.advance(batch, None) for batch in batches[split:]]
        caught_up = TextStream(tokenizer, inp)
        caught_up.catch_up(batches[:split])
        again = [caught_up.advance(batch, None) for batch in batches[split:]]
        assert [d and (d.text, d.finish_reason) for d in again] == [d and (d.text, d.finish_reason) for d in later]
        assert caught_up.output_token_ids == first.output_token_ids
        assert "".join(d.text for d in sent + again if d) == first.text == "Hello wörld! Say STOP?"
