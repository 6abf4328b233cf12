"""Stopping on SIGTERM/SIGINT without a lock in the main thread (cluster.process).

The handler runs in the main thread between bytecodes. ``Event.wait`` holds the event's lock
around its wakeup, and ``Event.set`` takes it: a second SIGTERM arriving just after the first
(a service manager and a terminal's process group both signalling) deadlocked `tandem serve`
(reproduced: 2 hangs in 3 tries with `timeout ... tandem serve` and `pkill -TERM`). Each test
holds the event's lock as ``Event.wait`` would and checks that nothing here waits for it."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tandem.cluster.process import sleep_unless_stopped, stop_on_signals


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _finishes_while_lock_held(stop: threading.Event, fn, *args) -> bool:
    done = threading.Thread(target=fn, args=args, daemon=True)
    with stop._cond:  # what Event.wait holds around its wakeup
        done.start()
        done.join(1.0)
        finished = not done.is_alive()
    done.join(5.0)
    return finished


def test_a_second_signal_takes_no_lock(restore_handlers):
    stop = stop_on_signals()
    handler = signal.getsignal(signal.SIGTERM)
    handler(signal.SIGTERM, None)
    assert stop.is_set()
    assert _finishes_while_lock_held(stop, handler, signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGINT) is handler


def test_sleep_unless_stopped_takes_no_lock():
    stop = threading.Event()
    results = []
    assert _finishes_while_lock_held(stop, lambda: results.append(sleep_unless_stopped(stop, 0.1)))
    assert results == [False]  # slept it out, not stopped


def test_sleep_unless_stopped_returns_soon_after_the_stop():
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert sleep_unless_stopped(stop, 10.0)
    assert time.monotonic() - started < 1.0
    assert sleep_unless_stopped(stop, 10.0)  # already stopped: at once
