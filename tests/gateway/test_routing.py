"""Token ordering/dedupe and decode-worker choice: pure logic, no Redis."""

from __future__ import annotations

from cluster.messages import TokenEvent, WorkerInfo
from gateway.router import choose_decode_worker
from gateway.streams import TokenAssembler


def ev(index, token_ids, finish=None, error=None):
    return TokenEvent("r", index, token_ids, finish, error)


def test_in_order_events():
    a = TokenAssembler()
    assert a.add(ev(0, [10])) == [10]
    assert a.add(ev(1, [11, 12])) == [11, 12]
    assert a.add(ev(3, [13], "length")) == [13]
    assert a.finish_reason == "length" and a.num_tokens == 4


def test_duplicates_and_overlaps_are_dropped():
    a = TokenAssembler()
    assert a.add(ev(0, [10])) == [10]
    assert a.add(ev(0, [10])) == []  # prefill retried
    assert a.add(ev(0, [10, 11, 12])) == [11, 12]  # a re-dispatch repeating known tokens
    assert a.add(ev(2, [12, 13], "stop")) == [13]
    assert a.finish_reason == "stop"
    assert a.add(ev(4, [99])) == []  # nothing after the end


def test_out_of_order_events_wait_for_the_gap():
    a = TokenAssembler()
    assert a.add(ev(1, [11])) == []
    assert a.add(ev(2, [12], "length")) == []
    assert a.finish_reason is None
    assert a.add(ev(0, [10])) == [10, 11, 12]
    assert a.finish_reason == "length"


def test_error_event_ends_with_its_message():
    a = TokenAssembler()
    a.add(ev(0, [10]))
    assert a.add(ev(1, [], "error", "kv handoff failed")) == []
    assert (a.finish_reason, a.error) == ("error", "kv handoff failed")


def test_error_after_the_first_token_ends_the_request():
    # prefill published token 0, then the handoff failed: decode reports the error at index 0
    a = TokenAssembler()
    assert a.add(ev(0, [10])) == [10]
    assert a.add(ev(0, [], "error", "transfer failed")) == []
    assert a.finish_reason == "error"


def worker(worker_id, free, running=0, waiting=0, block_size=16):
    return WorkerInfo(worker_id, "decode", "m", "inbox", 0, "h", 0.0, 0.0, 100, free, running, waiting, block_size)


def test_choose_prefers_the_worker_with_most_room_that_fits():
    workers = [worker("a", 10), worker("b", 30, running=5), worker("c", 20)]
    assert choose_decode_worker(workers, 100).worker_id == "b"


def test_choose_falls_back_to_least_loaded_when_none_fits():
    workers = [worker("a", 1, running=3), worker("b", 2, running=1, waiting=1), worker("c", 0, running=4)]
    assert choose_decode_worker(workers, 10_000).worker_id == "b"


def test_choose_with_no_worker():
    assert choose_decode_worker([], 10) is None
