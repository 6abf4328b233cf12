"""The live scheduling policies, in the ``keys.policy()`` hash, read by every worker between steps.

Fields ``capacity_scheduler_policy`` (decode workers) and
``context_chunking_policy`` (prefill workers). A worker sets a field from its
command line only where it is absent (the first worker started wins), then
re-reads the hash at most every ``interval_s``. An operator switches the whole
cluster through the admin API (``tandem.gateway.admin``), e.g.::

    tandem admin set-policy --capacity-scheduler-policy MAX_UTILIZATION

A value that names no policy is logged and ignored: the last good one stays.
"""

from __future__ import annotations

import time

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.policies import CAPACITY_POLICY_NAMES, CHUNKING_POLICY_NAMES
from tandem.cluster.settings import Settings

log = structlog.get_logger(__name__)

FIELDS = {"capacity_scheduler_policy": CAPACITY_POLICY_NAMES, "context_chunking_policy": CHUNKING_POLICY_NAMES}
REFRESH_INTERVAL_S = 0.5


class LivePolicies:
    def __init__(self, client: redis.Redis, settings: Settings, interval_s: float = REFRESH_INTERVAL_S):
        self._client = client
        self._interval_s = interval_s
        self._read_at = float("-inf")
        self.capacity_scheduler_policy = settings.capacity_scheduler_policy
        self.context_chunking_policy = settings.context_chunking_policy
        pipe = client.pipeline(transaction=False)
        for name in FIELDS:
            pipe.hsetnx(keys.policy(), name, getattr(self, name))
        pipe.hgetall(keys.policy())
        *_, live = pipe.execute()
        for name in FIELDS:  # the cluster's live value wins; a restarted worker's new flag would not
            raw = live.get(name.encode())
            if raw is not None and raw.decode() != getattr(self, name):
                log.warning("the cluster's live policy differs from this worker's flag; the live one applies",
                            field=name, live=raw.decode(), flag=getattr(self, name),
                            switch=f"tandem admin set-policy --{name.replace('_', '-')} {getattr(self, name)}")

    def refresh(self) -> "LivePolicies":
        """Re-read the hash if the last read is older than the interval (one HGETALL)."""
        now = time.monotonic()
        if now - self._read_at < self._interval_s:
            return self
        self._read_at = now
        values = self._client.hgetall(keys.policy())
        for name, allowed in FIELDS.items():
            raw = values.get(name.encode())
            value = raw.decode() if raw is not None else None
            if value is None or value == getattr(self, name):
                continue
            if value in allowed:
                log.info("policy switched", field=name, policy=value)
                setattr(self, name, value)
            else:
                log.warning("ignoring unknown policy", field=name, value=value)
        return self
