"""A stream that fell behind its workers takes every queued token at once: one delta, one SSE
event for the lot, the same text, tokens and logprobs as one event per token."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.cluster.messages import TokenEvent
from tandem.cluster.outputs import queue_events
from tandem.gateway.errors import WorkerLost
from tandem.gateway.token_events import read_queued_events
from tests.gateway.conftest import FakeDecodeWorker, parse_sse, post


async def _alive() -> bool:
    return True


def _event(index: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r", index, [10 + index], finish)


def test_queued_events_come_out_as_one_batch():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(3):
            queue.put_nowait(_event(i))
        events = read_queued_events(queue, deadline=time.monotonic() + 5, worker_alive=_alive)
        first = await anext(events)
        later = asyncio.create_task(anext(events))
        await asyncio.sleep(0.05)
        assert not later.done()  # nothing queued: the reader waits
        queue.put_nowait(_event(3, "length"))
        second = await later
        await events.aclose()
        return first, second

    first, second = asyncio.run(run())
    assert [e.index for e in first] == [0, 1, 2]
    assert [e.index for e in second] == [3]


def test_events_before_the_gateways_own_end_still_come_out():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_event(0))
        queue.put_nowait(_event(1))
        queue.put_nowait(WorkerLost("gateway stopping"))
        queue.put_nowait(_event(2))
        events = read_queued_events(queue, deadline=time.monotonic() + 5, worker_alive=_alive)
        batch = await anext(events)
        with pytest.raises(WorkerLost):
            await anext(events)
        return batch

    assert [e.index for e in asyncio.run(run())] == [0, 1]


class BurstWorker(FakeDecodeWorker):
    """Token 0 at once; every later token, after a pause, in one published batch (as a worker's
    events pile up in Redis while the gateway is busy)."""

    def _play(self, req) -> None:
        events = [ev for _, ev in self.script(req)]
        for part in (events[:1], events[1:]):
            pipe = self.client.pipeline(transaction=False)
            queue_events(pipe, [(req.reply_to, ev) for ev in part])
            pipe.execute()
            time.sleep(0.2)
        self._release(req.request_id)


def _script(token_ids):
    def script(req):
        k = req.sampling.logprobs
        return [(0.0, TokenEvent(req.request_id, i, [t], "length" if i == len(token_ids) - 1 else None,
                                 logprobs=None if k is None else [[-(i + 1.0), [[t, -(i + 1.0)]][:k]]]))
                for i, t in enumerate(token_ids)]

    return script


def test_a_burst_of_tokens_streams_as_one_event(serve, redis_url, tokenizer, text_ids):
    worker = BurstWorker(redis_url, _script(text_ids[:6])).start()
    try:
        server = serve()
        response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "stream": True, "logprobs": 1})
        chunks = [c for c in parse_sse(response.text) if c != "[DONE]"]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(texts) == tokenizer.decode(text_ids[:6])
        assert len([t for t in texts if t]) == 2  # token 0, then the five that arrived together
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        assert [lp for part in logprobs for lp in part["token_logprobs"]] == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        whole = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 6}).json()
        assert whole["choices"][0]["text"] == tokenizer.decode(text_ids[:6])
    finally:
        worker.stop()
