"""Liveness subscriptions (tandem.cluster.liveness) on a real redis-server: a run whose process is
gone is found as soon as its record is a beat late, never while it beats, and a live one whose
connection dropped is found live again after its next beat; records that name no channel (an
older worker) are left to their TTL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import redis

from tandem.cluster import keys
from tandem.cluster.liveness import LivenessChannel, ended_runs
from tandem.cluster.messages import WorkerInfo, encode
from tandem.cluster.registry import Heartbeat

INTERVAL_S, TTL_S = 0.2, 5.0


@pytest.fixture(scope="module")
def redis_url():
    from tandem.redis_server import RedisServer

    server = RedisServer()
    client = redis.Redis.from_url(server.url)
    while client.info("server")["uptime_in_seconds"] < 1:  # a Redis just started judges nobody yet
        time.sleep(0.05)
    yield server.url
    server.stop()


def _record(client, worker_id: str, channel: str = "", started_at: float = 1.0, interval_s: float = INTERVAL_S,
            age_s: float = 0.0) -> WorkerInfo:
    """A worker's registry record, written ``age_s`` ago (as its TTL left says)."""
    info = WorkerInfo(worker_id=worker_id, role="prefill", model="m", inbox="i", pid=1, host="h", started_at=started_at,
                      heartbeat_at=time.time(), num_total_blocks=8, num_free_blocks=8, heartbeat_ttl_s=TTL_S,
                      heartbeat_interval_s=interval_s, liveness_channel=channel)
    client.set(keys.worker("prefill", worker_id), encode(info), px=int((TTL_S - age_s) * 1000))
    return info


def test_a_closed_subscription_counts_once_a_beat_is_late_and_a_new_one_revives(redis_url):
    client = redis.Redis.from_url(redis_url)
    channel = LivenessChannel(redis_url, keys.liveness("prefill", "p0", 1.0), TTL_S)
    channel.ensure()
    channel.ensure()  # held: a PING, nothing new
    info = _record(client, "p0", channel.channel)
    assert ended_runs(client, "prefill", [info]) == set()
    channel.close()  # a dropped connection: not taken for a death while the record is fresh
    assert ended_runs(client, "prefill", [info]) == set()
    time.sleep(1.6 * INTERVAL_S)
    assert ended_runs(client, "prefill", [info]) == {("p0", 1.0)}
    channel.ensure()  # the next beat subscribes again
    info = _record(client, "p0", channel.channel)
    assert ended_runs(client, "prefill", [info]) == set()
    client.client_kill_filter(_type="pubsub")  # Redis drops it (as a restart would): the next beat notices
    channel.ensure()
    assert client.pubsub_numsub(channel.channel) == [(channel.channel.encode(), 1)]
    channel.close()


def test_a_redis_just_restarted_judges_nobody_until_every_worker_had_a_beat(tmp_path):
    """Restarted from its files it has the records, not the subscriptions: no run counts as
    ended before the workers had the time to subscribe again."""
    from tandem.redis_server import RedisServer

    server = RedisServer()
    try:
        client = redis.Redis.from_url(server.url)
        # beats every 2 s, its record 4 s old, nobody holds its channel: ended, but for the uptime
        info = _record(client, "p3", keys.liveness("prefill", "p3", 1.0), interval_s=2.0, age_s=4.0)
        assert ended_runs(client, "prefill", [info]) == set()
        assert client.info("server")["uptime_in_seconds"] <= 3
    finally:
        server.stop()


def test_an_older_workers_record_is_left_to_its_ttl(redis_url):
    client = redis.Redis.from_url(redis_url)
    old = _record(client, "p-old")  # names no channel
    time.sleep(1.6 * INTERVAL_S)
    assert ended_runs(client, "prefill", [old]) == set()


def test_a_killed_worker_process_is_found_within_a_beat_and_a_half(redis_url, tmp_path):
    """A child process heartbeats as a worker does (Heartbeat: its subscription, then its record),
    and is killed: its run is found ended before its record would expire."""
    code = (
        "import sys, time\n"
        "from tandem.cluster import keys\n"
        "from tandem.cluster.messages import WorkerInfo\n"
        "from tandem.cluster.registry import Heartbeat\n"
        "info = lambda: WorkerInfo(worker_id='p1', role='prefill', model='m', inbox='i', pid=1, host='h', "
        "started_at=2.0, heartbeat_at=0.0, num_total_blocks=8, num_free_blocks=8, heartbeat_ttl_s=5.0, "
        f"heartbeat_interval_s={INTERVAL_S}, liveness_channel=keys.liveness('prefill', 'p1', 2.0))\n"
        f"Heartbeat(sys.argv[1], info, {INTERVAL_S}, 5.0).start()\n"
        "print('beating', flush=True)\n"
        "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, redis_url], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "beating"
        client = redis.Redis.from_url(redis_url)
        from tandem.cluster.registry import live_workers

        (record,) = [w for w in live_workers(client, "prefill") if w.worker_id == "p1"]
        time.sleep(3 * INTERVAL_S)
        assert ended_runs(client, "prefill", [record]) == set()  # it beats
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed_at = time.monotonic()
        while not ended_runs(client, "prefill", [record]):
            assert time.monotonic() - killed_at < 1.5 * INTERVAL_S + 0.5
            time.sleep(0.01)
        assert client.exists(keys.worker("prefill", "p1"))  # found before its record expired
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_heartbeat_holds_its_runs_subscription_and_lets_it_go_on_stop(redis_url):
    client = redis.Redis.from_url(redis_url)
    channel = keys.liveness("prefill", "p2", 3.0)
    info = lambda: WorkerInfo(worker_id="p2", role="prefill", model="m", inbox="i", pid=1, host="h",  # noqa: E731
                              started_at=3.0, heartbeat_at=0.0, num_total_blocks=8, num_free_blocks=8,
                              heartbeat_ttl_s=TTL_S, heartbeat_interval_s=INTERVAL_S, liveness_channel=channel)
    heartbeat = Heartbeat(redis_url, info, INTERVAL_S, TTL_S)
    heartbeat.start()
    assert client.pubsub_numsub(channel) == [(channel.encode(), 1)]
    heartbeat.stop()
    assert client.pubsub_numsub(channel) == [(channel.encode(), 0)]
    assert not client.exists(keys.worker("prefill", "p2"))
