"""`tandem serve`: the whole cluster as supervised child processes of one command.

Starts a private redis-server (unless --redis-url; persistent, restarted like the
rest), the prefill and decode workers and the gateway under ``Supervisor``
(``tandem.supervisor``): a process that exits is restarted with backoff within a
restart budget, and no exit stops the others. It prints where it listens once
/health answers 200.

Stopping: SIGTERM or one Ctrl-C drains. The gateway refuses new requests (503
with Retry-After) and lets its open streams finish, for up to
--shutdown-timeout-s; then the workers stop, then Redis, and every process is
gone. A second signal ends the open streams at once (each gets an error event and
``[DONE]``) and stops everything.
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
import threading
import time
import urllib.request

from tandem.cluster.settings import Settings, env_name, flag_name, in_environment
from tandem.import_guard import python_argv
from tandem.models import resolve_model
from tandem.placement import count_gpus, plan
from tandem.redis_server import RedisServer, free_port, private_dir, redis_argv, wait_redis
from tandem.supervisor import ChildSpec, Supervisor

__all__ = ["RedisServer", "free_port", "serve", "service_argv", "stop_all", "wait_healthy", "wait_registered"]

GRACE_S = 10.0
READY_TIMEOUT_S = 600.0
TICK_S = 0.05  # how soon a signal or an exit is acted on
GATEWAY, WORKERS, REDIS = 0, 1, 2  # stop order
MAX_AUTO_GATEWAYS = 4
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable: where processes keep their metrics


class Signals:
    """SIGTERM and SIGINT counted, not acted on: the supervisor's loop reads the count (a
    handler that only adds to an int takes no lock, so it cannot deadlock the main thread)."""

    def __init__(self) -> None:
        self.count = 0
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, _signum, _frame) -> None:
        self.count += 1

    def is_set(self) -> bool:  # read as a threading.Event is, by wait_healthy and wait_registered
        return self.count > 0


def service_argv(role: str, settings: Settings, worker_id: str | None = None) -> list[str]:
    """The command line that starts one service with these settings.

    A setting goes on it when it differs from its default, or when this process's environment
    sets its variable (the flag then beats the child's copy of that variable); a default stays
    off it, so that a child started with an environment of its own (a per-host ``--kv-host``,
    ``--kv-trace``) takes that. Secrets are left off it (any local user reads command lines in
    ps): they are set in this process's environment instead, which the child inherits and
    reads them from, and removed from it where these settings have none (so no earlier value
    leaks into this child)."""
    import os
    from urllib.parse import urlsplit

    # a secret setting travels in its variable; a Redis URL is a secret when it holds a password
    secrets = {f.name: env_name(f) for f in dataclasses.fields(settings) if f.metadata.get("secret")}
    argv = python_argv("-m", "tandem", role)
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if field.name in secrets:
            url = urlsplit(value) if field.name == "redis_url" and value else None
            on_argv = url is not None and not (url.password or "password=" in url.query)  # nothing secret in it
            if value and not on_argv:
                os.environ[secrets[field.name]] = value if isinstance(value, str) else ",".join(value)
            else:
                os.environ.pop(secrets[field.name], None)
            if not on_argv:
                continue
        if value is None or field.name in ("worker_id", "restarts"):  # restarts: the supervisor's, per start
            continue
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if value == default and not in_environment(field):
            continue  # the child's default too, or what its own environment says (a per-host --kv-host)
        if isinstance(value, list):
            argv += [flag_name(field), *map(str, value)] if value else []
        else:
            argv += [flag_name(field), str(value)]
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


def wait_registered(redis_url: str, role: str, count: int, timeout_s: float, stop=None) -> bool:
    """Whether ``count`` workers of ``role`` registered within ``timeout_s``."""
    import redis

    from tandem.cluster.registry import live_workers

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return False
        try:
            if len(live_workers(client, role)) >= count:
                return True
        except redis.RedisError:
            pass  # Redis restarting: its supervisor brings it back
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


def masked_url(url: str) -> str:
    """A URL fit to print: its password (user info or ``password=``) as ***."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = urlencode([(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query)], safe="*/")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _check_free(settings: Settings) -> str | None:
    """Before starting anything: a server already there would answer our readiness check."""
    for host, port in ((settings.host, settings.port), (settings.admin_host, settings.admin_port)):
        try:
            if port:  # admin port 0: no admin API
                with socket.create_server((host, port)):
                    pass
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def _check_redis(url: str, source: str = "--redis-url", wait_s: float = 10.0) -> str | None:
    """Before starting anything: the Redis of --redis-url (or TANDEM_REDIS_URL) answers, with its
    password (one starting beside us gets ``wait_s``); otherwise every worker would fail on it and
    be restarted until the cluster gives up, with the reason only in their tracebacks."""
    import redis

    deadline = time.monotonic() + wait_s
    while True:
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
            try:
                client.ping()
            finally:
                client.close()
            return None
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # AuthenticationError is a ConnectionError
            retry, problem = not isinstance(exc, redis.AuthenticationError), exc
        except (redis.RedisError, OSError, ValueError) as exc:  # a bad URL, a refused command
            retry, problem = False, exc
        if not retry or time.monotonic() >= deadline:
            return f"cannot reach the Redis of {source} ({masked_url(url)}): {problem}"
        time.sleep(0.25)


def auto_gateway_processes(settings: Settings, num_gpus: int) -> int:
    """Gateway processes when --gateway-processes is 0: one per 4 cores, at most 4, on a GPU
    machine (one Python process streams about 10k tokens/s over HTTP: docs/benchmarks.md); one on
    the CPU, whose workers need the cores."""
    if settings.device == "cpu" or (num_gpus == 0 and not settings.device.startswith("cuda")):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_AUTO_GATEWAYS, cores // 4))


def _start(supervisor: Supervisor, settings: Settings, args: argparse.Namespace, signals: Signals,
           metrics_dir: str | None = None) -> bool:
    """Start the workers (prefill first: on a shared GPU the decode workers then size their pools
    from the memory the prefill workers left free) and the gateway; False if told to stop meanwhile."""
    num_gpus = count_gpus()
    placements = plan(num_gpus, settings.device, settings.kv_transport,
                      settings.num_prefill_workers, settings.num_decode_workers, settings.pools,
                      settings.tensor_parallel_size)
    threads = cpu_threads_per_worker(settings, num_gpus, len(placements))
    for role in ("prefill", "decode", "colocated"):
        for place in (p for p in placements if p.role == role):
            worker_settings = dataclasses.replace(settings, kv_transport=place.kv_transport or settings.kv_transport,
                                                  cpu_threads=threads)
            env = {**place.env, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
            name = f"{role}-{place.index}"
            supervisor.add(ChildSpec(name, service_argv(role, worker_settings, name), WORKERS, env))
            print(f"tandem: starting {name}" + (f" ({threads} CPU threads)" if threads else ""),
                  file=sys.stderr, flush=True)
        num_prefill = sum(p.role == "prefill" for p in placements)
        if role == "prefill" and num_prefill and not _wait(lambda: wait_registered(
                settings.redis_url, "prefill", num_prefill, 2.0, signals), supervisor, signals):
            return False
    num_gateways = settings.gateway_processes or auto_gateway_processes(settings, num_gpus)
    for index in range(num_gateways):
        # one admin API (the first gateway's); the others share --port through SO_REUSEPORT and
        # their metrics through prometheus_client's multiprocess directory
        gateway_settings = dataclasses.replace(settings, reuse_port=num_gateways > 1,
                                               admin_port=settings.admin_port if index == 0 else 0)
        env = {METRICS_DIR_ENV: metrics_dir} if num_gateways > 1 and metrics_dir else {}
        supervisor.add(ChildSpec("gateway" if index == 0 else f"gateway-{index}",
                                 service_argv("gateway", gateway_settings), GATEWAY, env))
    base = f"http://{settings.host}:{settings.port}"
    return _wait(lambda: wait_healthy(f"{base}/health", [], 2.0, signals), supervisor, signals)


def cpu_threads_per_worker(settings: Settings, num_gpus: int, num_workers: int) -> int:
    """Torch threads for each worker process on the CPU: the machine's cores divided among the
    workers' processes (each with all of them, they starve each other: measured in README; a
    worker of --tensor-parallel-size N is N processes), unless --cpu-threads sets it. 0 (torch's
    default) for workers on GPUs."""
    if settings.cpu_threads:
        return settings.cpu_threads
    if settings.device != "cpu" and (num_gpus > 0 or settings.device.startswith("cuda")):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores // max(num_workers * settings.tensor_parallel_size, 1), 1)


def _wait(ready, supervisor: Supervisor, signals: Signals) -> bool:
    """Poll ``ready`` (a short bounded wait) while supervising, up to READY_TIMEOUT_S."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not signals.is_set():
        if ready():
            return True
        lines, failed = supervisor.check()
        for line in lines:
            print(f"tandem: {line}", file=sys.stderr, flush=True)
        if failed is not None:
            return False
    return False


def _drain_and_stop(supervisor: Supervisor, settings: Settings, signals: Signals) -> None:
    """Gateways first (they drain their streams), then the workers, then Redis."""
    supervisor.stopping = True
    seen = signals.count
    supervisor.signal_group(GATEWAY, signal.SIGTERM)
    deadline = time.monotonic() + settings.shutdown_timeout_s + GRACE_S
    gateways = [c for c in supervisor.children if c.spec.stop_order == GATEWAY]
    while any(c.running() for c in gateways) and time.monotonic() < deadline:
        if signals.count > seen:  # a second signal: the gateways end their streams at once
            seen = signals.count
            supervisor.signal_group(GATEWAY, signal.SIGTERM)
            deadline = min(deadline, time.monotonic() + GRACE_S)
        time.sleep(0.05)
    supervisor.stop_all(GRACE_S)


def serve(args: argparse.Namespace) -> int:
    settings = Settings.from_args(args)
    settings.model = resolve_model(settings.model)
    settings.resolve()
    problem = _check_free(settings)
    if problem:
        print(f"tandem: {problem}", file=sys.stderr)
        return 1
    try:  # before the workers load the weights: the gateway needs it
        from tandem.cluster.tokenizer import load_tokenizer

        load_tokenizer(settings.tokenizer or settings.model)
    except Exception as exc:  # transformers raises several types for a missing or broken tokenizer
        print(f"tandem: cannot load the tokenizer of {settings.tokenizer or settings.model}: {exc}", file=sys.stderr)
        return 1
    signals = Signals()
    supervisor = Supervisor()
    redis_dir = None
    metrics_dir = private_dir("tandem-metrics-")  # prometheus_client's, when several gateways share a port
    try:
        if Settings.sources(args)["redis_url"] == "default":  # neither --redis-url nor TANDEM_REDIS_URL
            port, redis_dir = free_port(), private_dir("tandem-redis-")
            supervisor.add(ChildSpec("redis", redis_argv(port, redis_dir), REDIS, quiet=True))
            if not wait_redis(port):
                print("tandem: redis-server did not start", file=sys.stderr)
                return 1
            settings.redis_url = f"redis://127.0.0.1:{port}/0"
        else:
            given = Settings.sources(args)["redis_url"]
            problem = _check_redis(settings.redis_url, "--redis-url" if given == "flag" else given.split()[-1])
            if problem:
                print(f"tandem: {problem}", file=sys.stderr)
                return 1
        if not _start(supervisor, settings, args, signals, metrics_dir):
            if signals.is_set():
                return 0  # told to stop while starting
            print("tandem: the cluster did not start; stopping", file=sys.stderr)
            return 1
        admin = f", admin API {settings.admin_host}:{settings.admin_port}" if settings.admin_port else ""
        base = f"http://{settings.host}:{settings.port}"
        print(f"tandem: serving {settings.model_name} at {base}/v1 "
              f"(redis {masked_url(settings.redis_url)}{admin})", flush=True)
        print(f"  try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{settings.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"What is the capital of France?\"}}], \"max_tokens\": 32}}'", flush=True)
        while not signals.is_set():
            lines, failed = supervisor.check()
            for line in lines:
                print(f"tandem: {line}", file=sys.stderr, flush=True)
            if failed is not None:
                return 1
            time.sleep(TICK_S)
        _drain_and_stop(supervisor, settings, signals)
        return 0
    finally:
        supervisor.stop_all(GRACE_S)
        if redis_dir is not None:
            shutil.rmtree(redis_dir, ignore_errors=True)
        shutil.rmtree(metrics_dir, ignore_errors=True)
