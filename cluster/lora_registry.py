"""The LoRA adapters the cluster serves: one Redis hash, shared by every gateway.

``keys.lora_adapters()`` maps an adapter's name to its JSON record (``LoraRecord``: name,
path, digest, rank, created). A gateway writes a record once it has read and checked the
adapter against the base model (``tandem.gateway.lora_adapters``); any gateway then resolves a request
naming the adapter from it and puts the path and digest in the request's message. Workers never
read this hash: what they need travels with each request, so removing an adapter here changes
nothing for requests already running with it.

Registering is idempotent for the same name, path and digest (several gateway processes
register the same ``--lora-modules`` at startup); a name already served from another path or
with other weights is refused (``NameTaken``): a name means one adapter at a time. The first
registration is one HSETNX, so two gateways racing for a name cannot both win.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
import structlog

from tandem.cluster import keys

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LoraRecord:
    """One served adapter."""

    name: str
    path: str  # the PEFT directory every worker reads it from
    digest: str  # sha256 hex of its weights (engine.lora_adapter): a worker's copy must have it
    rank: int
    created: int  # Unix seconds: when it was first registered

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "LoraRecord":
        """Raises ValueError for anything but a record of the five fields with their types."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        record = cls(**{name: d[name] for name in ("name", "path", "digest", "rank", "created")})
        if not (isinstance(record.name, str) and isinstance(record.path, str) and isinstance(record.digest, str)
                and isinstance(record.rank, int) and isinstance(record.created, int)):
            raise ValueError(f"a field of the wrong type in {d}")
        return record

    def same_adapter(self, other: "LoraRecord") -> bool:
        """The same name, path and weights (another registration of it is no change)."""
        return (self.name, self.path, self.digest) == (other.name, other.path, other.digest)


class NameTaken(ValueError):
    """The name is served already, from another path or with other weights (``existing``)."""

    def __init__(self, existing: LoraRecord):
        super().__init__(f"the LoRA adapter name {existing.name!r} is already served from {existing.path!r} "
                         f"(digest {existing.digest[:12]})")
        self.existing = existing


def new_record(name: str, path: str, digest: str, rank: int) -> LoraRecord:
    return LoraRecord(name=name, path=path, digest=digest, rank=rank, created=int(time.time()))


class LoraRegistry:
    """The served set in Redis (``client``: a redis.asyncio client)."""

    def __init__(self, client: aioredis.Redis):
        self._client = client

    async def register(self, record: LoraRecord) -> tuple[LoraRecord, bool]:
        """Serve ``record`` -> (the record served under its name, whether this call added it).
        The same adapter served already: that record, False. Raises ``NameTaken``."""
        key = keys.lora_adapters()
        while True:
            if await self._client.hsetnx(key, record.name, record.to_json()):
                return record, True
            raw = await self._client.hget(key, record.name)
            if raw is None:
                continue  # unregistered between the two calls: try again
            existing = _parse(record.name, raw)
            if existing is None:
                raise NameTaken(LoraRecord(record.name, "(an unreadable record)", "", 0, 0))
            if existing.same_adapter(record):
                return existing, False
            raise NameTaken(existing)

    async def unregister(self, name: str) -> LoraRecord | None:
        """Stop serving ``name`` -> the record removed (None: it was not served)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hget(keys.lora_adapters(), name)
        pipe.hdel(keys.lora_adapters(), name)
        raw, removed = await pipe.execute()
        if not removed or raw is None:
            return None
        return _parse(name, raw) or LoraRecord(name, "", "", 0, 0)

    async def get(self, name: str) -> LoraRecord | None:
        raw = await self._client.hget(keys.lora_adapters(), name)
        return None if raw is None else _parse(name, raw)

    async def all(self) -> list[LoraRecord]:
        """Every served adapter, by name (unreadable records left out, logged)."""
        raws = await self._client.hgetall(keys.lora_adapters())
        records = (_parse(name.decode(errors="replace") if isinstance(name, bytes) else name, raw)
                   for name, raw in raws.items())
        return sorted((r for r in records if r is not None), key=lambda r: r.name)


def _parse(name: str, raw: str | bytes) -> LoraRecord | None:
    try:
        record = LoraRecord.from_json(raw)
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("unreadable LoRA adapter record ignored", name=name, error=str(exc))
        return None
    if record.name != name:
        log.warning("LoRA adapter record under another name ignored", name=name, record_name=record.name)
        return None
    return record
