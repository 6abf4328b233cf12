"""`tandem serve` as a user runs it: one command brings the cluster up, SIGTERM takes it all down."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from cluster.launcher import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_starts_everything_and_sigterm_stops_every_child(tiny_llama, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", tiny_llama, "--port", str(port),
         "--tokens-per-block", "4", "--max-seq-len", "256"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "wb"), text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once /health answers 200
        assert f"http://127.0.0.1:{port}/v1" in line, line
        children = _children(proc.pid)
        assert len(children) == 4  # redis-server, prefill, decode, gateway
        body = {"model": os.path.basename(tiny_llama), "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{c}") for c in children):
            time.sleep(0.1)
        leftovers = [c for c in children if os.path.exists(f"/proc/{c}")
                     and open(f"/proc/{c}/stat").read().split()[2] != "Z"]
        assert not leftovers, f"children still running: {leftovers}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_while_starting_stops_at_once(tiny_llama, tmp_path):
    """A stop asked for during start-up (say `docker stop` while the model loads) does not wait
    for the cluster to become ready first."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", tiny_llama, "--port", str(port),
         "--tokens-per-block", "4", "--max-seq-len", "256"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "wb"), text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:  # redis and a prefill worker
            time.sleep(0.05)
        children = _children(proc.pid)
        assert len(children) >= 2
        proc.send_signal(signal.SIGTERM)  # the launcher alone, as a service manager does
        started = time.monotonic()
        assert proc.wait(30) == 0
        assert time.monotonic() - started < 15
        assert "serving" not in proc.stdout.read()
        time.sleep(0.5)
        leftovers = [c for c in children if os.path.exists(f"/proc/{c}")
                     and open(f"/proc/{c}/stat").read().split()[2] != "Z"]
        assert not leftovers, f"children still running: {leftovers}"
    finally:
        if proc.poll() is None:
            proc.kill()
