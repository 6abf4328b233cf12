"""The supervisor on real child processes: restart with backoff, the budget, stop in order."""

from __future__ import annotations

import signal
import sys
import time

from tandem.supervisor import ChildSpec, RestartBudget, State, Supervisor


def _run(supervisor: Supervisor, until, timeout_s: float = 20.0) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new, failed = supervisor.check()
        lines += new
        if until(lines, failed):
            return lines
        time.sleep(0.02)
    raise AssertionError(lines)


def test_a_child_that_exits_is_restarted_and_told_how_often(tmp_path):
    out = tmp_path / "starts"
    code = f"import os; open({str(out)!r}, 'a').write(os.environ['TANDEM_RESTARTS'] + ' '); raise SystemExit(3)"
    supervisor = Supervisor(max_restarts=2, window_s=60)
    child = supervisor.add(ChildSpec("flaky", [sys.executable, "-c", code], 1))
    lines = _run(supervisor, lambda lines, failed: failed is not None)
    assert out.read_text().split() == ["0", "1", "2"]  # two restarts, then the budget is spent
    assert lines[0] == "flaky exited (code 3); restarting in 0.5 s"
    assert lines[1] == "flaky restarted (restart 1)"
    assert lines[-1] == "flaky exited (code 3) 3 times in 60 s; stopping the cluster"
    assert child.state is State.FAILED and child.num_restarts == 2


def test_the_budget_counts_restarts_within_its_window_only():
    budget = RestartBudget(max_restarts=2, window_s=10)
    budget.record(0.0)
    budget.record(1.0)
    assert not budget.can_restart(5.0)
    assert budget.can_restart(10.5)  # the first one left the window


def test_a_crash_of_one_child_leaves_the_others_running():
    supervisor = Supervisor()
    steady = supervisor.add(ChildSpec("steady", [sys.executable, "-c", "import time; time.sleep(60)"], 1))
    supervisor.add(ChildSpec("crashy", [sys.executable, "-c", "raise SystemExit(1)"], 1))
    try:
        _run(supervisor, lambda lines, failed: any("crashy restarted" in line for line in lines))
        assert steady.running() and steady.num_restarts == 0
    finally:
        supervisor.stop_all(grace_s=5)
    assert not steady.running()


def test_stop_all_goes_in_order_and_kills_what_ignores_sigterm(tmp_path):
    log = tmp_path / "order"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"

    def recorder(name):
        return (f"import signal, sys, time\n"
                f"def stop(*_):\n    open({str(log)!r}, 'a').write('{name} '); sys.exit(0)\n"
                f"signal.signal(signal.SIGTERM, stop)\ntime.sleep(60)")

    supervisor = Supervisor()
    redis = supervisor.add(ChildSpec("redis", [sys.executable, "-c", recorder("redis")], 2))
    worker = supervisor.add(ChildSpec("worker", [sys.executable, "-c", recorder("worker")], 1))
    gateway = supervisor.add(ChildSpec("gateway", [sys.executable, "-c", stubborn], 0))
    time.sleep(1.0)  # the handlers are installed
    started = time.monotonic()
    supervisor.stop_all(grace_s=1.0)
    assert log.read_text().split() == ["worker", "redis"]  # the gateway first (killed), then workers, Redis
    assert not any(c.running() for c in (redis, worker, gateway))
    assert gateway.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5
    supervisor.check()
    assert all(c.state is State.STOPPED for c in supervisor.children)  # nothing restarted after a stop


def test_the_ready_line_prints_no_redis_password():
    from tandem.launcher import masked_url

    assert masked_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert masked_url("rediss://u:p@h:1/0?password=x&ssl_ca_certs=/ca.pem") == \
        "rediss://u:***@h:1/0?password=***&ssl_ca_certs=/ca.pem"
    assert masked_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
