"""A real local cluster for end-to-end tests: redis-server, decode, prefill, gateway.

Every piece is the production process started the way `tandem serve` starts
it; tests talk to it over HTTP and read worker state from Redis. ``layout``:
"separate" (a prefill and a decode worker, the disaggregated design) or
"colocated" (one worker running both pools, ``tandem.colocated``, registered as
decode-0; there is no prefill worker whose blocks could be checked).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time

import redis

from tandem.cluster import keys
from tandem.launcher import RedisServer, free_port, service_argv, stop_all, wait_healthy
from tandem.cluster.messages import WorkerInfo, decode
from tandem.cluster.settings import Settings


LAYOUTS = ("separate", "colocated")


class LocalCluster:
    def __init__(self, model: str, log_dir: str, layout: str = "separate", **overrides):
        assert layout in LAYOUTS, layout
        self.layout = layout
        self.redis_server = RedisServer()
        self.settings = Settings(
            model=model,
            redis_url=self.redis_server.url,
            port=free_port(),
            admin_port=free_port(),
            heartbeat_interval_s=0.2,
            heartbeat_ttl_s=2.0,
            **overrides,
        ).resolve()
        self.base_url = f"http://{self.settings.host}:{self.settings.port}"
        self.admin_address = f"{self.settings.admin_host}:{self.settings.admin_port}"
        self.redis = redis.Redis.from_url(self.redis_server.url)
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start_service(self, role: str, worker_id: str | None = None, name: str | None = None,
                      env: dict[str, str] | None = None, **overrides) -> subprocess.Popen:
        """Start one service; ``overrides`` change its settings only (e.g. a second gateway's port);
        ``env``: added to its environment."""
        name = name or worker_id or role
        if role == "gateway" and "port" in overrides:
            overrides.setdefault("admin_port", free_port())  # a second gateway: its own admin port too
        settings = dataclasses.replace(self.settings, **overrides) if overrides else self.settings
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        proc = subprocess.Popen(service_argv(role, settings, worker_id), stdout=log, stderr=log,
                                env={**os.environ, **env} if env else None)
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 180.0) -> "LocalCluster":
        if self.layout == "colocated":
            self.start_service("colocated", "decode-0")
        else:
            self.start_service("decode", "decode-0")
            self.start_service("prefill", "prefill-0")
        self.start_service("gateway")
        if not wait_healthy(f"{self.base_url}/health", list(self.procs.values()), timeout_s):
            self.stop()
            raise RuntimeError(f"cluster did not become healthy; logs in {self.log_dir}:\n{self.logs()}")
        return self

    def worker(self, role: str, worker_id: str) -> WorkerInfo | None:
        raw = self.redis.get(keys.worker(role, worker_id))
        return decode(raw) if raw else None

    def start_two_decode(self, timeout_s: float = 180.0) -> "LocalCluster":
        """decode-0 and decode-1, one prefill worker and the gateway, both decode workers registered."""
        for worker_id in ("decode-0", "decode-1"):
            self.start_service("decode", worker_id)
        self.start_service("prefill", "prefill-0")
        self.start_service("gateway")
        if not wait_healthy(f"{self.base_url}/health", list(self.procs.values()), timeout_s):
            self.stop()
            raise RuntimeError(self.logs())
        deadline = time.monotonic() + 30
        while not all(self.worker("decode", w) for w in ("decode-0", "decode-1")) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self

    def busy_worker(self, role: str, worker_ids: tuple[str, ...] = ("decode-0", "decode-1")) -> str | None:
        """The first of ``worker_ids`` whose record shows a request running."""
        for worker_id in worker_ids:
            info = self.worker(role, worker_id)
            if info is not None and info.num_running > 0:
                return worker_id
        return None

    def kill_busy_worker(self, role: str, ready, timeout_s: float = 60.0,
                         worker_ids: tuple[str, ...] = ("decode-0", "decode-1")) -> str | None:
        """SIGKILL the worker running a request once ``ready()`` (e.g. tokens flow); -> its id
        (None: none was busy and ready within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            victim = self.busy_worker(role, worker_ids) if ready() else None
            if victim is not None:
                self.procs[victim].send_signal(signal.SIGKILL)
                return victim
            time.sleep(0.02)
        return None

    def wait_blocks_free(self, role: str, worker_id: str, timeout_s: float = 15.0) -> WorkerInfo | None:
        if role == "prefill" and self.layout == "colocated":
            return None  # no prefill worker: its prompts' blocks are decode-0's, checked there
        deadline = time.monotonic() + timeout_s
        info = None
        while time.monotonic() < deadline:
            info = self.worker(role, worker_id)
            if info and info.num_free_blocks == info.num_total_blocks and info.num_running == 0:
                return info
            time.sleep(0.1)
        raise AssertionError(f"{worker_id} still holds blocks: {info}")

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.log_dir)):
            if not name.endswith(".log"):
                continue
            with open(os.path.join(self.log_dir, name), errors="replace") as f:
                out.append(f"--- {name}\n" + f.read()[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        stop_all(list(self.procs.values()))
        self.redis_server.stop()
