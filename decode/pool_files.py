"""The decode worker's shared-memory KV pool files (the shm transport): ``tandem-kv-<worker
id>-<pid>`` in /dev/shm. A worker killed before its clean stop leaves its file (RAM) behind;
the next run of the same worker id removes it."""

from __future__ import annotations

import os

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
        pid = name[len(prefix):]
        if not name.startswith(prefix) or not pid.isdigit() or process_exists(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass  # someone else removed it first
    return removed
