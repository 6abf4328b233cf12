"""What every long-running tandem process does the same way: logging and stopping."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import structlog


def configure_logging(level: str, service: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    structlog.contextvars.bind_contextvars(service=service)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: worker loops check it between steps."""
    stop = threading.Event()

    def handler(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
