"""The console: log formats, the CPU threads tandem serve gives each worker, tandem status."""

from __future__ import annotations

import json
import subprocess
import sys

from tandem.cluster.settings import Settings
from tandem.launcher import cpu_threads_per_worker


def _log_line(fmt: str) -> str:
    code = ("from tandem.cluster.process import configure_logging; import structlog; "
            f"configure_logging('info', 'decode', {fmt!r}); structlog.get_logger().info('kv pool sized', num_blocks=8)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr.strip()


def test_json_lines_unless_asked_for_the_console():
    line = _log_line("auto")  # stderr is a pipe here: JSON
    assert json.loads(line)["event"] == "kv pool sized" and json.loads(line)["service"] == "decode"
    console = _log_line("console")
    assert "kv pool sized" in console and "num_blocks=8" in console and not console.startswith("{")


def test_tandem_serve_divides_the_cores_among_its_cpu_workers(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    cpu = Settings(device="cpu")
    assert cpu_threads_per_worker(cpu, num_gpus=0, num_workers=2) == 4
    assert cpu_threads_per_worker(cpu, num_gpus=0, num_workers=3) == 2
    assert cpu_threads_per_worker(cpu, num_gpus=0, num_workers=16) == 1
    assert cpu_threads_per_worker(Settings(device="cpu", cpu_threads=3), num_gpus=0, num_workers=2) == 3
    assert cpu_threads_per_worker(Settings(device="auto"), num_gpus=1, num_workers=2) == 0  # on the GPU: torch's own
    assert cpu_threads_per_worker(Settings(device="auto"), num_gpus=0, num_workers=2) == 4


def test_status_table_lines_up():
    from types import SimpleNamespace

    from tandem.gateway.status import rows, table

    worker = SimpleNamespace(worker_id="decode-0", role="decode", model="m", num_running=3, num_waiting=0,
                             num_free_blocks=10, num_total_blocks=64, num_restarts=1, draining=False, drained=False)
    text = table(rows([worker]))
    header, line = text.splitlines()
    assert header.split()[:3] == ["worker", "role", "model"]
    assert line.split() == ["decode-0", "decode", "m", "3", "0", "10/64", "1", "serving"]
