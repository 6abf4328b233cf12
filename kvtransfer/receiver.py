"""Decode side of one request's handoff.

Lifecycle: WAITING_FOR_INPUT (destination blocks reserved, prefill job sent)
-> SUCCESS (the prefill worker reported the KV complete) | FAILED (it
reported a failure, or nothing arrived before the deadline).
"""

from __future__ import annotations

import time

from tandem.kvtransfer.base import KVPoll


class KVReceiver:
    def __init__(self, timeout_s: float, now: float | None = None):
        self._deadline = (time.monotonic() if now is None else now) + timeout_s
        self._status = KVPoll.WAITING_FOR_INPUT
        self.error: str | None = None

    def on_done(self, ok: bool, error: str | None = None) -> None:
        if self._status is KVPoll.WAITING_FOR_INPUT:
            self._status = KVPoll.SUCCESS if ok else KVPoll.FAILED
            self.error = error

    def fail(self, error: str) -> None:
        self.on_done(False, error)

    def poll(self, now: float | None = None) -> KVPoll:
        if self._status is KVPoll.WAITING_FOR_INPUT and (time.monotonic() if now is None else now) > self._deadline:
            self.fail("KV transfer timed out")
        return self._status
