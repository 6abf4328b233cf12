"""The LoRA adapters a gateway serves (``--enable-lora``): load, unload, list, and a request's model.

Loading an adapter (``POST /v1/load_lora_adapter``, the admin API's ``LoadLoraAdapter``, each
``--lora-modules name=path`` at startup) reads and checks it against the base model exactly as
a worker will (``tandem.gateway.adapter_check``: the engine's check, in a child process, off the
event loop), then registers name, path, digest and rank in Redis
(``tandem.cluster.lora_registry``), where every gateway finds it. A refused adapter changes
nothing: 400 with the reason (its rank above --max-lora-rank, modules the engine serves no LoRA
on, another base model's shapes, options the engine does not apply, missing or unreadable files),
as for a name already served from another path, the base model's name, or a missing field. The
same adapter loaded again is no change (200). The path is made absolute: it is what every worker
reads.

Unloading removes the name from the served set: new requests naming it get 404
``model_not_found``, while requests already running with it finish (their messages carry its
path and digest).

``resolve(model)``: a request's ``model`` -> None (the base model) or the adapter's record, read
from Redis and kept ``CACHE_S`` (an unload takes effect on every gateway within that; a load at
once, as a name not found is always read again); an unknown name is 404 ``model_not_found``.
"""

from __future__ import annotations

import asyncio
import os
import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from tandem.cluster.lora_registry import LoraRecord, LoraRegistry, NameTaken, new_record
from tandem.cluster.settings import Settings
from tandem.gateway.adapter_check import AdapterChecker, AdapterRefused, CheckedAdapter, CheckFailed
from tandem.gateway.background import BackgroundTasks
from tandem.gateway.errors import AdapterNotFound, GatewayError, InvalidRequest, LoraNotEnabled, ModelNotFound

log = structlog.get_logger(__name__)

CACHE_S = 0.5  # how long a resolved adapter is kept before Redis is asked again
MAX_CACHED = 4096
MAX_NAME_CHARS = 256
STARTUP_RETRY_S = 1.0  # a --lora-modules registration that met a Redis error is retried this often

# AdapterError.reason -> what it means for the operator
_REFUSALS = {
    "rank": "its rank is above --max-lora-rank ({max_rank})",
    "targets": "it puts LoRA on modules the engine serves no LoRA on",
    "shape": "its shapes are not this base model's (an adapter of another model)",
    "option": "it uses an option the engine does not apply",
    "file": "its files are missing, unreadable or inconsistent",
}


class LoraAdapters:
    def __init__(self, settings: Settings, client: aioredis.Redis, checker: AdapterChecker | None = None,
                 cache_s: float = CACHE_S):
        self.enabled = settings.enable_lora
        self.base_model = settings.model_name
        self._base_names = {settings.model_name, settings.model}
        self._max_rank = settings.max_lora_rank
        self._startup = settings.lora_module_paths() if self.enabled else {}
        self._startup_records: list[LoraRecord] | None = None  # --lora-modules once checked
        self._registry = LoraRegistry(client)
        self._checker = checker
        if checker is None and self.enabled:
            self._checker = AdapterChecker(settings.model, settings.max_lora_rank)
        self._cache_s = cache_s
        self._cache: dict[str, tuple[float, LoraRecord]] = {}  # name -> (read at, record)

    # ---- the served set ---------------------------------------------------------------------
    async def load(self, name: str, path: str) -> tuple[LoraRecord, bool]:
        """Check the adapter at ``path`` and serve it as ``name`` -> (its record, whether it was
        added: False when that very adapter was served already). Raises LoraNotEnabled,
        InvalidRequest (nothing changed) or GatewayError (the check could not be made)."""
        self.check_enabled()
        name, path = self._valid_name(name), self._valid_path(path)
        served = await self._registry.get(name)
        if served is not None and served.path != path:  # refused before the check reads any file
            raise _name_taken(NameTaken(served))
        checked = await self._check(name, path)
        return await self._register(new_record(name, path, checked.digest, checked.rank))

    async def unload(self, name: str) -> LoraRecord:
        """Stop serving ``name`` for new requests -> the record removed. Raises LoraNotEnabled,
        InvalidRequest (no name) or AdapterNotFound."""
        self.check_enabled()
        if not isinstance(name, str) or not name:
            raise InvalidRequest("lora_name must not be empty", param="lora_name")
        record = await self._registry.unregister(name)
        self._cache.pop(name, None)
        if record is None:
            raise AdapterNotFound(f"the LoRA adapter {name!r} cannot be found: it is not loaded", param="lora_name")
        log.info("LoRA adapter unloaded", lora_name=name, path=record.path)
        return record

    async def list(self) -> list[LoraRecord]:
        """Every adapter served (none without --enable-lora), by name."""
        return await self._registry.all() if self.enabled else []

    async def resolve(self, model: str | None) -> LoraRecord | None:
        """A request's ``model`` -> None for the base model, else the served adapter of that
        name; raises ModelNotFound."""
        if model is None or model in self._base_names:
            return None
        if not self.enabled:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.base_model!r}",
                                param="model")
        now = time.monotonic()
        cached = self._cache.get(model)
        if cached is not None and now - cached[0] < self._cache_s:
            return cached[1]
        record = await self._registry.get(model)
        if record is None:
            self._cache.pop(model, None)
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.base_model!r} "
                                f"and the LoRA adapters loaded into it (GET /v1/models)", param="model")
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[model] = (now, record)
        return record

    # ---- startup ----------------------------------------------------------------------------
    async def check_startup_modules(self) -> None:
        """Check every ``--lora-modules`` adapter (once: later calls return at once). Raises
        InvalidRequest naming the module for a bad one, or GatewayError: the gateway must not
        start. Needs no Redis, nor the loop that serves: ``tandem gateway`` calls it before
        serving, so a bad module ends the process with one line."""
        if self._startup_records is not None:
            return
        records = []
        for name, path in self._startup.items():
            name, path = self._valid_name(name), self._valid_path(path)
            checked = await self._check(name, path)
            records.append(new_record(name, path, checked.digest, checked.rank))
        self._startup_records = records

    async def serve_startup_modules(self, background: BackgroundTasks) -> None:
        """Check (``check_startup_modules``) and serve every ``--lora-modules`` adapter, as
        ``load`` does; another gateway process serving the same one already is no change. A name
        served from another path raises InvalidRequest. A Redis error leaves a registration to a
        retry in the background."""
        await self.check_startup_modules()
        for record in self._startup_records:
            try:
                await self._register(record)
            except RedisError as exc:
                log.warning("cannot register a --lora-modules adapter yet: retrying", lora_name=record.name,
                            error=str(exc))
                background.spawn(self._register_later(record))

    async def _register_later(self, record: LoraRecord) -> None:
        while True:
            await asyncio.sleep(STARTUP_RETRY_S)
            try:
                await self._register(record)
                return
            except RedisError:
                continue
            except InvalidRequest as exc:
                log.error("cannot serve a --lora-modules adapter", lora_name=record.name, error=exc.message)
                return

    def close(self) -> None:
        if self._checker is not None:
            self._checker.close()

    # ---- helpers ----------------------------------------------------------------------------
    def check_enabled(self) -> None:
        """Raises LoraNotEnabled without --enable-lora."""
        if not self.enabled:
            raise LoraNotEnabled("LoRA is not enabled on this server: start it with --enable-lora to load "
                                 "and unload LoRA adapters")

    def _valid_name(self, name) -> str:
        if not isinstance(name, str) or not name:
            raise InvalidRequest("lora_name must not be empty", param="lora_name")
        if name != name.strip() or not name.isprintable() or len(name) > MAX_NAME_CHARS:
            raise InvalidRequest(f"lora_name {name[:MAX_NAME_CHARS]!r} is not a valid name: printable characters, "
                                 f"no leading or trailing space, at most {MAX_NAME_CHARS}", param="lora_name")
        if name in self._base_names:
            raise InvalidRequest(f"lora_name {name!r} is the base model's name: an adapter needs a name of "
                                 "its own", param="lora_name")
        return name

    @staticmethod
    def _valid_path(path) -> str:
        if not isinstance(path, str) or not path.strip():
            raise InvalidRequest("lora_path must not be empty", param="lora_path")
        return os.path.abspath(path)

    async def _check(self, name: str, path: str) -> CheckedAdapter:
        try:
            return await self._checker.check(path)
        except AdapterRefused as exc:
            why = _REFUSALS.get(exc.reason, exc.reason).format(max_rank=self._max_rank)
            raise InvalidRequest(f"cannot load LoRA adapter {name!r} from {path!r}: {why} ({exc.reason}): {exc}",
                                 param="lora_path", code="invalid_lora_adapter") from None
        except CheckFailed as exc:
            raise GatewayError(f"LoRA adapter {name!r} could not be checked: {exc}") from None

    async def _register(self, record: LoraRecord) -> tuple[LoraRecord, bool]:
        try:
            served, added = await self._registry.register(record)
        except NameTaken as exc:
            raise _name_taken(exc, record.path) from None
        self._cache.pop(record.name, None)
        if added:
            log.info("LoRA adapter loaded", lora_name=record.name, path=record.path, rank=record.rank,
                     digest=record.digest[:12])
        return served, added


def _name_taken(exc: NameTaken, path: str | None = None) -> InvalidRequest:
    """``path``: the one asked for; the served one's files changed since it was loaded when equal."""
    changed = " with other weights: its files changed since it was loaded" if path == exc.existing.path else ""
    return InvalidRequest(f"{exc}{changed}: unload it first (POST /v1/unload_lora_adapter, or tandem admin "
                          f"lora-unload {exc.existing.name})", param="lora_name", code="lora_adapter_exists")
