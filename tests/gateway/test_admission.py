"""Admission across the pool: reservations, the bounded queue, 429s, leak repair, the preemption metric,
the live policy hash."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tandem.cluster import keys
from tandem.cluster.admission import RESERVE_LUA, Reservations
from tandem.cluster.messages import WorkerInfo
from tandem.gateway.admission_queue import AdmissionQueue
from tandem.gateway.errors import ClientDisconnected, ServerBusy
from tandem.gateway.metrics import GatewayMetrics
from tests.gateway.conftest import token_script, wait_for

HOLD = token_script([5, 6, 7], "length", delay_s=0.4)  # a request that holds its room for ~1.2 s
FILL = {"prompt": "hi", "max_tokens": 20}  # 1-2 prompt tokens + 20: two 16-token blocks, the whole pool below


def post(server, body, timeout=20):
    return httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)


def fill_the_pool(server):
    """Start a request that takes the whole (2-block) pool; returns its thread."""
    thread = threading.Thread(target=post, args=(server, FILL))
    thread.start()
    time.sleep(0.3)
    return thread


def assert_429(response, code):
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("rate_limit_error", code) and error["message"]


def test_full_queue_is_429_at_once(serve, fake_worker):
    fake_worker(HOLD, num_total_blocks=2)
    server = serve(max_queue_len=0)
    holder = fill_the_pool(server)
    started = time.time()
    assert_429(post(server, FILL), "queue_full")
    assert time.time() - started < 0.5
    holder.join()
    assert post(server, FILL).status_code == 200  # the room came back


def test_queued_request_times_out_with_429(serve, fake_worker):
    fake_worker(HOLD, num_total_blocks=2)
    server = serve(max_queue_len=4, queue_timeout_s=0.3)
    holder = fill_the_pool(server)
    started = time.time()
    assert_429(post(server, FILL), "queue_timeout")
    assert 0.25 < time.time() - started < 1.0
    holder.join()


def test_queued_request_runs_once_room_frees(serve, fake_worker):
    worker = fake_worker(HOLD, num_total_blocks=2)
    server = serve(max_queue_len=4, queue_timeout_s=10)
    holder = fill_the_pool(server)
    response = post(server, FILL)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    holder.join()
    assert len(worker.requests) == 2
    text = httpx.get(server.url + "/metrics").text
    assert 'tandem_gateway_requests_total{route="/v1/completions",status="200"} 2.0' in text
    assert "tandem_gateway_requests_queued 0.0" in text


class FakeRouter:
    """Takes requests only while ``room`` > 0; records the order it took them in."""

    def __init__(self):
        self.room = 0
        self.taken: list[str] = []

    async def reserve(self, request_id, num_prompt_tokens, max_tokens, resumed=False, prompt=None):
        if self.room <= 0:
            return None
        self.room -= 1
        self.taken.append(request_id)
        return WorkerInfo("w", "decode", "m", "inbox", 0, "h", 0.0, 0.0, 1, 1)


def test_queue_admits_by_priority_then_arrival():
    async def scenario():
        router = FakeRouter()
        queue = AdmissionQueue(router, max_queue_len=8, queue_timeout_s=5, poll_s=0.001)
        tasks = []
        for request_id, priority in [("a", 5), ("b", 0), ("c", 5), ("d", 0)]:
            tasks.append(asyncio.create_task(queue.admit(request_id, 1, 1, priority)))
            await asyncio.sleep(0.005)
        assert queue.num_queued == 4
        for _ in range(4):
            router.room += 1
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
        return router.taken, queue.num_queued

    assert asyncio.run(scenario()) == (["b", "d", "a", "c"], 0)


def test_resumed_requests_go_ahead_of_new_ones_and_are_never_refused():
    async def scenario():
        router = FakeRouter()
        queue = AdmissionQueue(router, max_queue_len=2, queue_timeout_s=5, poll_s=0.001)
        tasks = []
        for request_id, priority, resumed in [("a", 0, False), ("b", 0, False), ("r1", 0, True), ("r2", 0, True),
                                              ("hi", -1, False)]:
            tasks.append(asyncio.create_task(queue.admit(request_id, 1, 1, priority, resumed=resumed)))
            await asyncio.sleep(0.005)
        for _ in range(5):
            router.room += 1
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return router.taken, [type(r).__name__ for r in results if isinstance(r, Exception)]

    taken, errors = asyncio.run(scenario())
    # "hi" came with a full queue (2 new + 2 resumed waiting) and is refused; resumed ones were not
    assert taken == ["r1", "r2", "a", "b"] and errors == ["ServerBusy"]


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        queue = AdmissionQueue(FakeRouter(), max_queue_len=1, queue_timeout_s=5, poll_s=0.001)
        waiter = asyncio.create_task(queue.admit("a", 1, 1))
        await asyncio.sleep(0.01)
        with pytest.raises(ServerBusy):
            await queue.admit("b", 1, 1)  # the one place is taken
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return queue.num_queued

    assert asyncio.run(scenario()) == 0


def test_waiter_whose_client_left_leaves_the_queue():
    async def scenario():
        router = FakeRouter()
        queue = AdmissionQueue(router, max_queue_len=2, queue_timeout_s=5, poll_s=0.001)
        head = asyncio.create_task(queue.admit("head", 1, 1))
        left = asyncio.Event()
        waiter = asyncio.create_task(queue.admit("a", 1, 1, client_left=left))
        await asyncio.sleep(0.05)
        assert queue.num_queued == 2 and not waiter.done()
        left.set()  # behind the head: its leaving wakes it at once
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(waiter, 0.2)
        assert queue.num_queued == 1
        head.cancel()
        await asyncio.gather(head, return_exceptions=True)
        router.room = 1
        return queue.num_queued, await queue.admit("b", 1, 1), router.taken

    num_queued, worker, taken = asyncio.run(scenario())
    assert num_queued == 0 and worker.worker_id == "w" and taken == ["b"]  # "a" was never admitted


def test_a_waiting_crowd_costs_the_event_loop_nothing():
    """10,000 queued requests whose clients stay: while none can be admitted, only the head wakes
    (to ask the router every poll_s); the others sleep until they reach the head or leave."""
    async def scenario():
        router = FakeRouter()
        queue = AdmissionQueue(router, poll_s=0.05, queue_timeout_s=60)
        lefts = [asyncio.Event() for _ in range(10_000)]
        tasks = [asyncio.create_task(queue.admit(str(i), 1, 1, client_left=left)) for i, left in enumerate(lefts)]
        await asyncio.sleep(0.5)
        assert queue.num_queued == 10_000
        started = time.process_time()
        await asyncio.sleep(2.0)
        idle_cpu_s = time.process_time() - started
        lefts[-1].set()  # the last one leaves: at once, though it never reached the head
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(tasks[-1], 0.5)
        router.room = 3  # the first three in line go, in order
        await asyncio.wait_for(asyncio.gather(*tasks[:3]), 2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return idle_cpu_s, router.taken, queue.num_queued

    idle_cpu_s, taken, num_queued = asyncio.run(scenario())
    assert idle_cpu_s < 0.05, idle_cpu_s  # waking each waiter once a second cost about 0.2 s here
    assert taken == ["0", "1", "2"] and num_queued == 0


def test_client_that_leaves_while_queued_frees_its_place(serve, fake_worker):
    """Its place in the queue goes to the next client at once (no 429 queue_full for it), and the
    worker never receives it."""
    worker = fake_worker(token_script([5, 6, 7], "length", delay_s=0.8), num_total_blocks=2)  # holds ~2.4 s
    server = serve(max_queue_len=1, queue_timeout_s=10)
    holder = fill_the_pool(server)
    with pytest.raises(httpx.ReadTimeout):
        post(server, FILL, timeout=0.4)  # queued, then gone
    queued = "tandem_gateway_requests_queued 0.0"
    assert wait_for(lambda: queued in httpx.get(server.url + "/metrics").text, timeout_s=1.0)
    assert holder.is_alive()  # the pool is still full: the next client queues in the freed place
    response = post(server, FILL)
    assert response.status_code == 200, response.text
    holder.join()
    assert len(worker.requests) == 2 and not worker.aborts


def test_reconcile_releases_entries_the_worker_never_received(rclient):
    reserve = rclient.register_script(RESERVE_LUA)
    worker_keys = [keys.admitted("w"), keys.reserved_tokens("w")]
    for request_id in ("known", "lost"):
        assert reserve(keys=worker_keys, args=[request_id, 32, 1024, 0]) == 0
    assert reserve(keys=worker_keys, args=["known", 32, 1024, 0]) == 0  # a replayed call charges once
    reservations = Reservations(rclient, "w")
    assert reservations.reconcile({"known"}) == []  # unknown once: maybe still in the inbox
    assert reservations.reconcile({"known"}) == ["lost"]  # unknown twice: never arrived
    assert int(rclient.get(keys.reserved_tokens("w"))) == 32
    reservations.release(["known", "known"])
    assert int(rclient.get(keys.reserved_tokens("w"))) == 0 and rclient.hlen(keys.admitted("w")) == 0


def test_preemption_counter_follows_the_workers_count():
    workers = {"decode": [WorkerInfo("decode-0", "decode", "m", "inbox", 0, "h", 0.0, 0.0, 10, 10,
                                     num_preemptions=3)],
               "prefill": [WorkerInfo("prefill-0", "prefill", "m", "inbox", 0, "h", 0.0, 0.0, 10, 10)]}
    text = GatewayMetrics(lambda: workers).render().decode()
    assert "# TYPE tandem_preemptions_total counter" in text
    assert 'tandem_preemptions_total{worker="decode-0"} 3.0' in text
    assert 'worker="prefill-0"' not in text.split("tandem_preemptions_total", 1)[1]


def test_live_policies_start_from_flags_switch_and_ignore_junk(rclient):
    from structlog.testing import capture_logs

    from tandem.cluster.live_policies import LivePolicies
    from tandem.cluster.settings import Settings

    rclient.hset(keys.policy(), "context_chunking_policy", "EQUAL_PROGRESS")  # set by an earlier worker
    with capture_logs() as logs:
        policies = LivePolicies(rclient, Settings(capacity_scheduler_policy="MAX_UTILIZATION"), interval_s=0.05)
    differs = [e for e in logs if e["log_level"] == "warning"]  # this worker's flag (FCFS) is not what applies
    assert [(e["field"], e["live"], e["flag"]) for e in differs] == [
        ("context_chunking_policy", "EQUAL_PROGRESS", "FIRST_COME_FIRST_SERVED")]
    assert rclient.hgetall(keys.policy()) == {b"capacity_scheduler_policy": b"MAX_UTILIZATION",
                                               b"context_chunking_policy": b"EQUAL_PROGRESS"}
    assert policies.refresh().context_chunking_policy == "EQUAL_PROGRESS"  # the hash wins over the flag
    rclient.hset(keys.policy(), "capacity_scheduler_policy", "STATIC_BATCH")
    assert policies.refresh().capacity_scheduler_policy == "MAX_UTILIZATION"  # read at most every interval
    time.sleep(0.06)
    assert policies.refresh().capacity_scheduler_policy == "STATIC_BATCH"
    rclient.hset(keys.policy(), "capacity_scheduler_policy", "FASTEST")
    time.sleep(0.06)
    assert policies.refresh().capacity_scheduler_policy == "STATIC_BATCH"  # junk is ignored
