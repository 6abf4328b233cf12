"""Token ordering/dedupe and decode-worker admission arguments: pure logic, no Redis."""

from __future__ import annotations

from tandem.cluster.messages import TokenEvent, WorkerInfo
from tandem.gateway.router import admission_args, tie_order
from tandem.gateway.token_events import TokenAssembler


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


def worker(worker_id, free, running=0, waiting=0, block_size=16, total=100, policy="", max_batch_size=0):
    return WorkerInfo(worker_id, "decode", "m", "inbox", 0, "h", 0.0, 0.0, total, free, running, waiting, block_size,
                      max_seq_len=1024, capacity_scheduler_policy=policy, max_batch_size=max_batch_size)


def test_charge_follows_the_workers_policy():
    # (charge, capacity tokens, max requests); 20-token prompt, 100 new tokens, 16-token blocks
    assert admission_args(worker("a", 0, policy="GUARANTEED_NO_EVICT"), 20, 100) == [128, 1600, 0]
    assert admission_args(worker("a", 0, policy="STATIC_BATCH"), 20, 100) == [128, 1600, 0]
    assert admission_args(worker("a", 0, policy="MAX_UTILIZATION", max_batch_size=8), 20, 100) == [32, 1600, 8]
    assert admission_args(worker("a", 0), 20, 100)[0] == 128  # a worker that names no policy: no-evict
    assert admission_args(worker("a", 0, total=4), 20, 100)[0] == 64  # never more than the whole pool


def test_ties_go_to_the_most_free_blocks_then_the_least_loaded():
    workers = [worker("a", 10), worker("b", 30, running=5), worker("c", 30, running=1), worker("d", 20)]
    assert [w.worker_id for w in tie_order(workers)] == ["c", "b", "d", "a"]
