"""Shared-memory KV pool files (the shm transport): ``tandem-kv-<worker id>-<pid>`` in /dev/shm,
a decode worker's pool, and a split model's ranks' (``<that>.rank<r>``, ``engine.tensor_parallel``).
A worker killed before its clean stop leaves its files (RAM) behind; the next run of the same
worker id removes them."""

from __future__ import annotations

import os
import tempfile

from tandem.cluster.process import process_exists


def remove_stale_pool_files(directory: str, prefix: str) -> list[str]:
    """Remove ``<directory>/<prefix><pid>`` pool files whose process is gone (a worker killed
    before its clean stop leaves its file, RAM in /dev/shm, behind); -> the paths removed.
    Only one worker's prefix: a worker never touches another's files."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):].split(".rank")[0]  # a rank's file goes with its worker's process
        if not name.startswith(prefix) or not pid.isdigit() or process_exists(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass  # someone else removed it first
    return removed


def pool_dir(configured: str | None) -> str:
    """Where the shm pool files go: --shm-dir (made if missing; another tmpfs than a container's
    small /dev/shm, say), else /dev/shm, else the temp directory."""
    if configured:
        os.makedirs(configured, mode=0o700, exist_ok=True)
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_pool_path(directory: str, worker_id: str) -> str:
    """This process's pool file for ``worker_id``, the files of its earlier runs that did not
    stop cleanly (SIGKILL) removed first."""
    remove_stale_pool_files(directory, f"tandem-kv-{worker_id}-")
    return os.path.join(directory, f"tandem-kv-{worker_id}-{os.getpid()}")
