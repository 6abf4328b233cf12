"""`tandem serve` as a user runs it: one command brings the cluster up, SIGTERM takes it all down."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tandem.redis_server import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _start_serve(tiny_llama: str, port: int, tmp_path, admin_port: int | None = None, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tandem", "serve", "--model", tiny_llama, "--port", str(port),
         "--admin-port", str(admin_port or free_port()), "--tokens-per-block", "4", "--max-seq-len", "256", *extra],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "wb"), text=True,
    )


def _running(pids: list[int], wait_s: float) -> list[int]:
    """Those of ``pids`` still running (not zombies) after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        running = [p for p in pids
                   if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


def _kill_all(proc: subprocess.Popen, children: list[int]) -> None:
    """After a test, pass or fail: the launcher and every child it had, killed (a child left
    running would hold a core and a port through the rest of the suite)."""
    if proc.poll() is None:
        children = children + _children(proc.pid)
        proc.kill()
        proc.wait()
    for pid in _running(children, wait_s=0):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _assert_stopped(proc: subprocess.Popen, children: list[int], returncode: int) -> None:
    assert proc.wait(30) == returncode
    leftovers = _running(children, wait_s=10)
    assert not leftovers, f"children still running: {leftovers}"


@pytest.mark.parametrize("pools", ["auto", "separate"])
def test_serve_starts_everything_and_sigterm_stops_every_child(tiny_llama, tmp_path, pools):
    """auto on the CPU: one worker runs both pools (colocated-0); separate: a prefill and a decode worker."""
    port, admin_port = free_port(), free_port()
    proc = _start_serve(tiny_llama, port, tmp_path, admin_port, "--pools", pools)
    workers = ["colocated-0"] if pools == "auto" else ["decode-0", "prefill-0"]
    children: list[int] = []  # what the finally kills, whatever failed
    try:
        line = proc.stdout.readline()  # printed once /health answers 200
        assert f"http://127.0.0.1:{port}/v1" in line and f"admin API 127.0.0.1:{admin_port}" in line, line
        children = _children(proc.pid)
        assert len(children) == 2 + len(workers)  # redis-server, the workers, gateway
        body = {"model": os.path.basename(tiny_llama), "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
        admin = subprocess.run([sys.executable, "-m", "tandem", "admin", "--address", f"127.0.0.1:{admin_port}",
                                "workers"], capture_output=True, text=True, timeout=60)
        assert admin.returncode == 0, admin.stderr
        assert sorted(w["worker_id"] for w in json.loads(admin.stdout)["workers"]) == workers
        status = subprocess.run([sys.executable, "-m", "tandem", "status", "--address", f"127.0.0.1:{admin_port}"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[0].split()[0] == "worker" and [ln.split()[0] for ln in lines[1:1 + len(workers)]] == workers
        assert "policies: capacity GUARANTEED_NO_EVICT" in status.stdout
        proc.send_signal(signal.SIGTERM)
        _assert_stopped(proc, children, returncode=0)
    finally:
        _kill_all(proc, children)


def test_sigterm_while_starting_stops_at_once(tiny_llama, tmp_path):
    """A stop asked for during start-up (say `docker stop` while the model loads) does not wait
    for the cluster to become ready first."""
    port = free_port()
    proc = _start_serve(tiny_llama, port, tmp_path)
    children: list[int] = []  # what the finally kills, whatever failed
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:  # redis and a worker
            time.sleep(0.05)
        children = _children(proc.pid)
        assert len(children) >= 2
        proc.send_signal(signal.SIGTERM)  # the launcher alone, as a service manager does
        started = time.monotonic()
        assert proc.wait(30) == 0
        assert time.monotonic() - started < 15
        assert "serving" not in proc.stdout.read()
        leftovers = _running(children, wait_s=0.5)
        assert not leftovers, f"children still running: {leftovers}"
    finally:
        _kill_all(proc, children)


def test_an_unreachable_redis_url_is_refused_before_anything_starts(tiny_llama, tmp_path):
    """TANDEM_REDIS_URL (a password in it) naming a Redis that is not there: `tandem serve` says
    which setting and where, the password masked, and starts no child."""
    dead_port = free_port()  # nothing listens on it
    env = {**os.environ, "TANDEM_REDIS_URL": f"redis://:sekrit-9d1@127.0.0.1:{dead_port}/0"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", tiny_llama, "--port", str(free_port()),
                           "--admin-port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr
    assert f"cannot reach the Redis of TANDEM_REDIS_URL (redis://:***@127.0.0.1:{dead_port}/0)" in done.stderr
    assert "sekrit" not in done.stderr + done.stdout
    assert "tandem: starting" not in done.stderr and "serving" not in done.stdout
    assert time.monotonic() - started < 60  # the 10 s wait, not a worker's restarts
