"""tandem.decode.batch_wait: when a decode step sharing its GPU with prefill waits for joiners."""

import os
import types

import pytest

from tandem.cluster.messages import WorkerInfo
from tandem.decode.batch_wait import JOIN_HORIZON_S, BatchWait, shares_gpu


def _shared(max_wait_s=0.2, max_batch_size=128):
    wait = BatchWait(max_wait_s, max_batch_size)
    wait.shared = True
    return wait


def test_holds_while_requests_in_prefill_would_grow_the_batch_by_a_quarter():
    wait = _shared()
    assert wait.hold(num_running=8, num_prefilling=2, now=0.0)  # +25%
    assert wait.hold(num_running=8, num_prefilling=2, now=0.1)
    assert not wait.hold(num_running=8, num_prefilling=1, now=0.15)  # +12.5%: the step goes
    assert not wait.holding
    assert wait.num_holds == 1


def test_a_hold_lasts_at_most_max_wait_then_the_step_goes_and_a_new_hold_may_begin():
    wait = _shared(max_wait_s=0.2)
    assert wait.hold(10, 100, now=0.0)
    assert wait.hold(10, 100, now=0.199)
    assert not wait.hold(10, 100, now=0.2)  # waited long enough: this step runs
    assert wait.hold(10, 100, now=0.21)  # the next one is held again, from now
    assert not wait.hold(10, 100, now=0.42)
    assert wait.num_holds == 2


def test_never_holds_without_a_shared_gpu_without_a_wait_or_without_room_to_grow():
    unshared = BatchWait(0.2, 128)
    assert not unshared.hold(1, 100, now=0.0)  # a GPU of its own: holding would only delay
    assert not _shared(max_wait_s=0.0).hold(1, 100, now=0.0)  # --decode-batch-wait-ms 0
    assert not _shared().hold(0, 100, now=0.0)  # nothing running: nothing to hold
    full = _shared(max_batch_size=16)
    assert not full.hold(16, 100, now=0.0)  # the batch is full: nobody could join it
    assert not full.hold(14, 100, now=0.0)  # 2 could join: +14%
    assert full.hold(12, 100, now=0.0)  # 4 could join: +33%


def test_a_negative_wait_is_refused():  # the flag itself: tests/unit/test_settings.py
    with pytest.raises(ValueError, match="max_wait_s"):
        BatchWait(-1.0, 8)


def _prefill(host, device):
    return WorkerInfo(worker_id="p", role="prefill", model="m", inbox="i", pid=1, host=host, started_at=0.0,
                      heartbeat_at=0.0, num_total_blocks=1, num_free_blocks=1, device=device)


def test_the_gpu_is_shared_only_with_a_prefill_worker_on_the_same_gpu():
    here, gpu = os.uname().nodename, "cuda-GPU-1234"
    assert shares_gpu(gpu, [_prefill("elsewhere", "cuda-GPU-9"), _prefill(here, gpu)])
    assert not shares_gpu(gpu, [_prefill(here, "cuda-GPU-9")])  # another GPU (nccl)
    assert shares_gpu(gpu, [_prefill("prefill-container", gpu)])  # a container on the same GPU
    assert not shares_gpu(gpu, [_prefill(here, "")])  # a worker that does not say
    assert not shares_gpu("cpu", [_prefill(here, "cpu")])  # CPU processes run on different cores
    assert not shares_gpu("", [_prefill(here, "")])


def test_only_recent_live_prefills_count_as_joining():
    def request(dispatched_at, abort_requested=False):
        return types.SimpleNamespace(dispatched_at=dispatched_at, abort_requested=abort_requested)

    now = 100.0
    prefilling = [
        request(now - 0.5),  # under way: joins soon
        request(now - 0.1, abort_requested=True),  # aborted: only waits for its PrefillDone
        request(now - JOIN_HORIZON_S - 0.1),  # stuck (or deep in a queue): not waited for
        request(None),  # not handed to a prefill worker (none alive)
    ]
    assert BatchWait.num_joining(prefilling, now) == 1
