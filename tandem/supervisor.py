"""`tandem serve`'s supervision: start each process, restart what exits, stop in order.

A child's life::

    STARTING --(its process runs)--> RUNNING --(it exits)--> BACKOFF --(delay)--> STARTING ...
        RUNNING --(it exits with its restart budget spent)--> FAILED (the cluster stops)
        any --(stop)--> STOPPED

A child that exits is started again after a backoff (0.5 s, doubling to 8 s) within
a restart budget (``max_restarts`` in ``window_s``, by default 5 in 60 s); no
child's exit stops the others. Each start gets ``TANDEM_RESTARTS`` (its --restarts setting: how many
times it was restarted) in its environment, which a worker reports in the
registry (``tandem admin workers``, the gateway's /metrics).

Children run in process groups of their own, so a terminal's Ctrl-C reaches only
the supervisor, which then stops them in order (gateways first, so that their
streams can finish; then the workers; Redis last); each also gets SIGTERM should
the supervisor die (PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

RESTARTS_ENV = "TANDEM_RESTARTS"  # a child's --restarts setting (tandem.cluster.settings: TANDEM_<FLAG>)

BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
PR_SET_PDEATHSIG = 1


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class ChildSpec:
    name: str  # e.g. decode-0, prefill-0, gateway, redis
    argv: list[str]
    stop_order: int  # lower stops first: gateways 0, workers 1, redis 2
    env: dict[str, str] = field(default_factory=dict)
    quiet: bool = False  # its output is dropped (redis-server's banner)


class RestartBudget:
    """At most ``max_restarts`` restarts in any ``window_s``."""

    def __init__(self, max_restarts: int = 5, window_s: float = 60.0):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()

    def can_restart(self, now: float) -> bool:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times) < self.max_restarts

    def record(self, now: float) -> None:
        self._times.append(now)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Child:
    def __init__(self, spec: ChildSpec, budget: RestartBudget):
        self.spec = spec
        self.budget = budget
        self.state = State.STOPPED
        self.proc: subprocess.Popen | None = None
        self.num_restarts = 0
        self.last_exit_code: int | None = None
        self._start_at = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> None:
        env = {**os.environ, **self.spec.env, RESTARTS_ENV: str(self.num_restarts)}
        # stdout is the supervisor's own (its ready line): a child's output goes to stderr
        out = subprocess.DEVNULL if self.spec.quiet else sys.stderr
        self.proc = subprocess.Popen(self.spec.argv, env=env, stdout=out, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.state = State.RUNNING

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self, now: float) -> str | None:
        """Notice an exit and schedule the restart (or fail); start a child whose backoff is over.
        Returns a line worth printing, if any."""
        if self.state is State.RUNNING and not self.running():
            self.last_exit_code = self.proc.returncode
            if not self.budget.can_restart(now):
                self.state = State.FAILED
                return (f"{self.name} exited (code {self.last_exit_code}) {self.budget.max_restarts + 1} times "
                        f"in {self.budget.window_s:.0f} s; stopping the cluster")
            self.budget.record(now)
            delay = BACKOFF_S[min(self.num_restarts, len(BACKOFF_S) - 1)]
            self.num_restarts += 1
            self.state, self._start_at = State.BACKOFF, now + delay
            return f"{self.name} exited (code {self.last_exit_code}); restarting in {delay:.1f} s"
        if self.state is State.BACKOFF and now >= self._start_at:
            self.start()
            return f"{self.name} restarted (restart {self.num_restarts})"
        return None

    def signal(self, sig: int) -> None:
        if self.running():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group (what it started dies with it)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
        self.state = State.STOPPED


class Supervisor:
    def __init__(self, max_restarts: int = 5, window_s: float = 60.0):
        self.children: list[Child] = []
        self._max_restarts, self._window_s = max_restarts, window_s
        self.stopping = False

    def add(self, spec: ChildSpec, start: bool = True) -> Child:
        child = Child(spec, RestartBudget(self._max_restarts, self._window_s))
        self.children.append(child)
        if start:
            child.start()
        return child

    def check(self, now: float | None = None) -> tuple[list[str], Child | None]:
        """One look at every child: (lines to print, the child whose budget is spent or None).
        While stopping, nothing is restarted."""
        if self.stopping:
            return [], None
        now = time.monotonic() if now is None else now
        lines, failed = [], None
        for child in self.children:
            line = child.check(now)
            if line:
                lines.append(line)
            if child.state is State.FAILED and failed is None:
                failed = child
        return lines, failed

    def stop_group(self, order: int, sig: int, timeout_s: float) -> bool:
        """Signal the children of one stop order and wait up to ``timeout_s`` for them to exit;
        False if some are still running (they are left running)."""
        group = [c for c in self.children if c.spec.stop_order == order]
        for child in group:
            child.signal(sig)
        deadline = time.monotonic() + timeout_s
        while any(c.running() for c in group) and time.monotonic() < deadline:
            time.sleep(0.05)
        return not any(c.running() for c in group)

    def signal_group(self, order: int, sig: int) -> None:
        for child in self.children:
            if child.spec.stop_order == order:
                child.signal(sig)

    def stop_all(self, grace_s: float) -> None:
        """Every order in turn: SIGTERM, ``grace_s`` to exit, then SIGKILL of what is left."""
        self.stopping = True
        for order in sorted({c.spec.stop_order for c in self.children}):
            self.stop_group(order, signal.SIGTERM, grace_s)
            for child in self.children:
                if child.spec.stop_order == order:
                    child.kill_group()
