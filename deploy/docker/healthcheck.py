#!/usr/bin/env python3
"""tandem-healthcheck ROLE [--liveness]: is this container's prefill or decode worker registered?

Exit 0 when the cluster's Redis (``--redis-url``, else TANDEM_REDIS_URL, as the worker itself
reads it) holds a live registry record of a ROLE worker that runs here: the record's host is
this machine's name (a container's or pod's own), and where the record's PID namespace is this
one, its process exists. A worker registers once its model is loaded and its KV pool is up, and
its record lives as long as its heartbeats, so this is "started and alive". Exit 1 otherwise,
with one line saying why.

``--liveness``: a Redis that does not answer counts as healthy (nothing can be told about the
worker then, and restarting it would not bring Redis back); only an answer without the record
fails. Readiness checks leave it out.
"""

from __future__ import annotations

import argparse
import os
import sys

import redis

from tandem.cluster.registry import live_workers
from tandem.cluster.process import pid_namespace, process_exists

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
TIMEOUT_S = 3.0


def ours(info, host: str, namespace: int) -> bool:
    """Whether a registry record is of a worker running in this container."""
    if info.host != host:
        return False
    if info.pid_namespace and namespace and info.pid_namespace == namespace:
        return process_exists(info.pid)
    return True  # another PID namespace (or one unknown): the host name decides


def check(role: str, redis_url: str, liveness: bool = False) -> tuple[int, str]:
    """(exit status, the line to print)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    try:
        workers = live_workers(client, role)
    except redis.RedisError as exc:
        if liveness:
            return 0, f"redis does not answer ({type(exc).__name__}): the {role} worker is not judged"
        return 1, f"redis does not answer: {type(exc).__name__}: {exc}"
    finally:
        client.close()
    host, namespace = os.uname().nodename, pid_namespace()
    mine = [info.worker_id for info in workers if ours(info, host, namespace)]
    if mine:
        return 0, f"{role} worker registered: {', '.join(sorted(mine))}"
    return 1, f"no live registry record of a {role} worker on {host}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--redis-url", default=os.environ.get("TANDEM_REDIS_URL") or DEFAULT_REDIS_URL)
    parser.add_argument("--liveness", action="store_true",
                        help="a Redis that does not answer counts as healthy")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status, line = check(args.role, args.redis_url, args.liveness)
    print(line, file=sys.stdout if status == 0 else sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
