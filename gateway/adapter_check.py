"""Checking a LoRA adapter against the base model, in a child process.

The check is the engine's own (``tandem.engine.lora_adapter.load_lora_adapter``: the PEFT files
read, every option, rank, target and shape checked, the digest of the weights computed), so
the gateway refuses exactly what a worker would refuse and hands the workers the digest their
copy must have. The engine imports torch and the gateway does not (tests/unit/test_layers.py),
so the check runs in a child (``python -P -c CHILD``) that reads one request per line on its
stdin and answers one JSON line: ``{"digest", "rank"}`` or ``{"reason", "message"}`` (an
``AdapterError``), or ``{"error"}`` (the base model's config cannot be read).

The child is started on first use and kept while it is used, so loading several adapters
imports torch once; idle for ``IDLE_S`` it exits (and its memory goes back), and the next check
starts another. Checks run one at a time on a thread of their own, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

IDLE_S = 60.0  # the child exits after this long without a check
CHECK_TIMEOUT_S = 300.0  # one check, the child's start (torch's import) included

# argv: model, max rank, idle seconds. Replies go to a copy of fd 1; fd 1 itself becomes stderr,
# so nothing the imported libraries print can be taken for a reply.
CHILD = r"""
import json, os, select, sys
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
model, max_rank, idle_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    import tandem  # first: its import guard keeps the checkout's folders from shadowing packages
    import torch
    torch.set_num_threads(1)
    from tandem.engine.config import ModelConfig
    from tandem.engine.lora_adapter import AdapterError, load_lora_adapter
    config, broken = ModelConfig.from_pretrained(model), None
except Exception as exc:
    broken = f"{type(exc).__name__}: {exc}"

def answer(path):
    if broken is not None:
        return {"error": f"the base model's config ({model}) cannot be read: {broken}"}
    try:
        adapter = load_lora_adapter(path, config, max_rank)
    except AdapterError as exc:
        return {"reason": exc.reason, "message": str(exc)}
    except Exception as exc:
        return {"reason": "file", "message": f"{path!r} cannot be read: {type(exc).__name__}: {exc}"}
    return {"digest": adapter.digest, "rank": adapter.rank}

# one request at a time (the parent waits for each reply), so the line buffer never hides one
while select.select([sys.stdin], [], [], idle_s)[0]:
    line = sys.stdin.readline()
    if not line:
        break
    replies.write(json.dumps(answer(json.loads(line)["path"])) + "\n")
    replies.flush()
"""


@dataclass(frozen=True)
class CheckedAdapter:
    path: str
    digest: str
    rank: int


class AdapterRefused(ValueError):
    """The engine will not serve the adapter; ``reason`` is ``AdapterError.reason`` (file, option,
    rank, targets, shape)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class CheckFailed(RuntimeError):
    """The check itself could not be made (the child died or hung, the base model's config is unreadable)."""


class AdapterChecker:
    def __init__(self, model: str, max_rank: int, *, idle_s: float = IDLE_S, timeout_s: float = CHECK_TIMEOUT_S):
        self._argv = [sys.executable, "-P", "-c", CHILD, model, str(max_rank), str(idle_s)]
        self._timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._pending = b""  # read from the child past the last reply (nothing, as it answers one at a time)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-check")

    async def check(self, path: str) -> CheckedAdapter:
        """Read and check the adapter in directory ``path``; raises AdapterRefused or CheckFailed."""
        reply = await asyncio.get_running_loop().run_in_executor(self._executor, self._ask, path)
        if "digest" in reply:
            return CheckedAdapter(path, reply["digest"], int(reply["rank"]))
        if "reason" in reply:
            raise AdapterRefused(reply["reason"], reply["message"])
        raise CheckFailed(reply.get("error", f"unexpected reply {reply}"))

    def close(self) -> None:
        """Stop the child after the check under way, if any (it also exits by itself: idle, or
        when its stdin closes with this process)."""
        self._executor.submit(self._close_child)
        self._executor.shutdown(wait=False)

    # ---- on the check thread ----------------------------------------------------------------
    def _ask(self, path: str) -> dict:
        for attempt in (0, 1):
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps({"path": path}) + "\n").encode())
                self._proc.stdin.flush()
                return json.loads(self._read_line())
            except (BrokenPipeError, EOFError) as exc:
                # a child that exited idle as the request went out: once more with a new one
                code = self._discard()
                if attempt or code != 0:
                    raise CheckFailed(f"the adapter check process exited (code {code}): see the gateway's log"
                                      ) from exc
        raise AssertionError("unreachable")

    def _close_child(self) -> None:
        if self._proc is not None:
            self._discard()

    def _start(self) -> None:
        self._pending = b""
        self._proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=None, close_fds=True)
        log.info("started the LoRA adapter check process", pid=self._proc.pid)

    def _read_line(self) -> bytes:
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + self._timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._discard(kill=True)
                raise CheckFailed(f"checking the adapter took longer than {self._timeout_s:.0f} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _discard(self, kill: bool = False) -> int:
        """Let the current child go -> its exit code: its stdin closed (it exits), killed if it
        still runs after a moment, or at once with ``kill``."""
        proc, self._proc = self._proc, None
        if kill:
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            return proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
