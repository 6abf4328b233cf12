"""`tandem serve`: the whole cluster as child processes of one command.

Starts a private redis-server (unless --redis-url), the decode and prefill
workers and the gateway; prints where it listens once /health answers 200;
on Ctrl-C or SIGTERM stops every child (SIGTERM, then SIGKILL after a grace
period). If any child dies, the others are stopped too and the exit code is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from tandem.placement import count_gpus, plan
from tandem.cluster.settings import Settings
from tandem.models import resolve_model

GRACE_S = 10.0
READY_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server on a free loopback port, data in a temp dir."""

    def __init__(self, port: int | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it (Debian: apt-get install redis-server) "
                               "or pass --redis-url")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="tandem-redis-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def service_argv(role: str, settings: Settings, worker_id: str | None = None) -> list[str]:
    """The command line that starts one service with these settings.

    Secrets are left off it (any local user reads command lines in ps): they are set in this
    process's environment instead, which the child inherits and reads them from, and removed
    from it where these settings have none (so no earlier value leaks into this child)."""
    import os

    secrets = {"admin_token": "TANDEM_ADMIN_TOKEN", "api_keys": "TANDEM_API_KEY"}  # field -> its flag's variable
    argv = [sys.executable, "-m", "tandem", role]
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if field.name in secrets:
            if value:
                os.environ[secrets[field.name]] = value if isinstance(value, str) else ",".join(value)
            else:
                os.environ.pop(secrets[field.name], None)
            continue
        if value is None or field.name == "worker_id":
            continue
        argv += [f"--{field.name.replace('_', '-')}", str(value)]
    if worker_id:
        argv += ["--worker-id", worker_id]
    return argv


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float,
                 stop: threading.Event | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs) or (stop is not None and stop.is_set()):
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def wait_registered(redis_url: str, role: str, count: int, procs: list[subprocess.Popen], timeout_s: float,
                    stop: threading.Event | None = None) -> bool:
    import redis

    from tandem.cluster.registry import live_workers

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs) or (stop is not None and stop.is_set()):
            return False
        if len(live_workers(client, role)) >= count:
            return True
        time.sleep(0.2)
    return False


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve(args: argparse.Namespace) -> int:
    from tandem.cluster.service import sleep_unless_stopped, stop_on_signals

    settings = Settings.from_args(args)
    settings.model = resolve_model(settings.model)
    settings.resolve()
    # before starting anything: a server already there would answer our readiness check
    for host, port in ((settings.host, settings.port), (settings.admin_host, settings.admin_port)):
        try:
            if port:  # admin port 0: no admin API
                with socket.create_server((host, port)):
                    pass
        except OSError as exc:
            print(f"tandem: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    try:  # before the workers load the weights: the gateway needs it
        from tandem.gateway.tokenizer import load_tokenizer

        load_tokenizer(settings.model)
    except Exception as exc:  # transformers raises several types for a missing or broken tokenizer
        print(f"tandem: cannot load the tokenizer of {settings.model}: {exc}", file=sys.stderr)
        return 1
    stop = stop_on_signals()
    redis_server = None if args.redis_url else RedisServer()
    if redis_server is not None:
        settings.redis_url = redis_server.url
    procs: list[subprocess.Popen] = []
    try:
        # prefill workers first: on a shared GPU the decode workers then size
        # their pools from the memory the prefill workers left free
        placements = plan(count_gpus(), settings.device, settings.kv_transport,
                          args.num_prefill_workers, args.num_decode_workers)
        for role in ("prefill", "decode"):
            for place in (p for p in placements if p.role == role):
                worker_settings = dataclasses.replace(settings, kv_transport=place.kv_transport or settings.kv_transport)
                argv = service_argv(role, worker_settings, f"{role}-{place.index}")
                procs.append(subprocess.Popen(argv, env={**os.environ, **place.env}))
            if role == "prefill" and not wait_registered(
                settings.redis_url, "prefill", args.num_prefill_workers, procs, READY_TIMEOUT_S, stop
            ):
                if stop.is_set():
                    return 0  # told to stop while starting
                print("tandem: the prefill workers did not start; stopping", file=sys.stderr)
                return 1
        procs.append(subprocess.Popen(service_argv("gateway", settings)))
        base = f"http://{settings.host}:{settings.port}"
        if not wait_healthy(f"{base}/health", procs, READY_TIMEOUT_S, stop):
            if stop.is_set():
                return 0
            print("tandem: the cluster did not become healthy; stopping", file=sys.stderr)
            return 1
        admin = f", admin API {settings.admin_host}:{settings.admin_port}" if settings.admin_port else ""
        print(f"tandem: serving {settings.model_name} at {base}/v1 (redis {settings.redis_url}{admin})", flush=True)
        watched = procs + ([redis_server.proc] if redis_server is not None else [])  # its own redis too
        while not sleep_unless_stopped(stop, 0.5):
            if any(p.poll() is not None for p in watched):
                print("tandem: a service exited; stopping the cluster", file=sys.stderr)
                return 1
        return 0
    finally:
        stop_all(procs)
        if redis_server is not None:
            redis_server.stop()
