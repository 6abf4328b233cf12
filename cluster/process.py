"""What every long-running tandem process does the same way: logging and stopping."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import structlog


def configure_logging(level: str, service: str, fmt: str = "auto") -> None:
    """structlog on stderr: one readable line per event in a terminal (``console``), JSON lines
    when it is not one or when asked (``json``)."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if console
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso" if not console else "%H:%M:%S"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    structlog.contextvars.bind_contextvars(service=service)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: worker loops check it between steps.

    The main thread must never block in ``stop.wait()`` (use ``sleep_unless_stopped``): the
    handler runs in the main thread, and ``Event.set`` takes the lock that ``Event.wait``
    holds around its wakeup, so a signal landing there would deadlock (a second SIGTERM a
    moment after the first hung ``tandem serve`` this way)."""
    stop = threading.Event()

    def handler(signum, _frame):
        if not stop.is_set():  # a second signal takes no lock
            stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def sleep_unless_stopped(stop: threading.Event, seconds: float, tick_s: float = 0.05) -> bool:
    """Sleep up to ``seconds``, returning early (True) once ``stop`` is set; takes no lock, so
    safe in the main thread while a signal handler may set ``stop``."""
    deadline = time.monotonic() + seconds
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(tick_s, remaining))
    return True


def process_exists(pid: int) -> bool:
    """Whether a process with this id runs on this host (in this PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where there is none):
    two processes can tell whether a pid of one names a process of the other's only when
    they share it (containers with one hostname can have separate ones)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
