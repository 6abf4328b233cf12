"""The redis-server `tandem serve` runs when no --redis-url is given (and the tests' own).

``redis_argv`` is the command line of a persistent one: append-only file in a data
directory only its owner can read (drains, policies and in-flight streams survive a
restart of the process), listening on loopback. ``RedisServer`` runs a throwaway one
on a free port, without persistence, for tests and tools.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: install it (Debian: apt-get install redis-server) "
                           "or pass --redis-url")
    return binary


def private_dir(prefix: str) -> str:
    """A new directory readable by its owner only (mkdtemp's mode, kept whatever the umask)."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o700)
    return path


def redis_argv(port: int, data_dir: str, persistent: bool = True) -> list[str]:
    argv = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", data_dir,
            "--daemonize", "no", "--loglevel", "warning", "--save", ""]
    # appendfsync everysec: a kill -9 loses at most the last second, which the workers' outboxes
    # and the gateways' failover make good
    argv += ["--appendonly", "yes", "--appendfsync", "everysec"] if persistent else ["--appendonly", "no"]
    return argv


def wait_redis(port: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


class RedisServer:
    """A throwaway redis-server on a free loopback port, data in a temp dir."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.dir = private_dir("tandem-redis-")
        self.proc = subprocess.Popen(redis_argv(self.port, self.dir, persistent=False), stdout=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        if not wait_redis(self.port):
            self.stop()
            raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
