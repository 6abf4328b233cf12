"""The adapters a worker's requests name: read in the background, checked against the request.

A request (GenerateRequest, PrefillJob) names its LoRA adapter by name, the PEFT directory every
worker reads it from and the digest of its weights (``engine.lora_adapter``) the gateway saw when
it was loaded. A worker that does not hold that adapter yet reads it from the path on a thread
of its own, so that the step loop goes on with other requests' steps while the files are read and
checked; the request waits here (``hold``) and is handed back by ``poll`` once its adapter is
registered with the worker's ``LoraManager`` (whose slots the steps use), or failed with the reason.

The adapters a worker is started with (``--lora-modules``) are read before it serves
(``preload``), as vLLM loads them at startup. A read at run time shares the GIL with the step
loop; the reader takes it back only a few times per adapter (``engine.lora_adapter``), so a read
beside a busy loop takes about as long as alone.

An adapter is registered under its ``AdapterRef.key``, name and digest together: a name
unloaded and loaded again with other weights is another adapter, and requests still running
with the old one keep it. An adapter whose files no longer have the digest the request carries
is refused with a clear error instead of computing something else.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog

from tandem.engine.lora_adapter import AdapterError, LoraAdapter, load_lora_adapter
from tandem.engine.lora_manager import LoraManager

T = TypeVar("T")
log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AdapterRef:
    """A request's adapter, as its message names it."""

    name: str
    path: str
    digest: str

    @property
    def key(self) -> str:
        """The name the worker's LoraManager holds it under (name and weights)."""
        return f"{self.name}@{self.digest[:16]}"

    @classmethod
    def of(cls, msg) -> "AdapterRef | None":
        """A GenerateRequest's or PrefillJob's adapter (None: the base model)."""
        if not (msg.lora_name or msg.lora_path or msg.lora_digest):
            return None
        return cls(msg.lora_name, msg.lora_path, msg.lora_digest)


class AdapterLoads(Generic[T]):
    """Requests (anything: the worker's records) waiting for their adapter, and the reads under way.
    ``manager`` None: the worker serves no adapters, and every request naming one is refused."""

    def __init__(self, manager: LoraManager | None, startup: dict[str, str] | None = None) -> None:
        """``startup``: the adapters the worker was started with (name -> path), read now."""
        self.manager = manager
        self._executor: ThreadPoolExecutor | None = None
        self._reads: dict[str, tuple[AdapterRef, Future]] = {}  # key -> the read under way
        self._waiting: dict[str, list[T]] = {}  # key -> requests waiting for it, in arrival order
        if manager is not None and startup:
            self.preload(startup)

    def preload(self, modules: dict[str, str]) -> list[str]:
        """Read and register ``modules`` (name -> path) now, each under the key requests naming it
        with these weights carry -> the keys registered. An adapter that cannot be read is logged
        and left to the requests that name it (they get the reason)."""
        keys = []
        for name, path in modules.items():
            try:
                adapter = load_lora_adapter(path, self.manager.config, self.manager.max_rank)
                key = AdapterRef(name, path, adapter.digest).key
                self.manager.register(key, adapter)
            except Exception as exc:  # the gateway refuses a bad startup adapter with its reason
                log.warning("LoRA adapter not preloaded", lora_name=name, path=path, error=str(exc))
                continue
            keys.append(key)
        return keys

    def problem(self, ref: AdapterRef) -> str | None:
        """Why a request naming ``ref`` cannot run here at all (None: it can, now or once read)."""
        if self.manager is None:
            return f"the request names the LoRA adapter {ref.name!r}, but this worker serves none (--enable-lora)"
        if not (ref.name and ref.path and ref.digest):
            return f"the request's LoRA adapter lacks its name, path or digest: {ref}"
        return None

    def ready(self, ref: AdapterRef) -> bool:
        """Whether ``ref``'s adapter is registered: its requests may run now."""
        return self.manager is not None and ref.key in self.manager

    def hold(self, ref: AdapterRef, request: T) -> None:
        """Keep ``request`` until its adapter is read (starting the read unless one is under way)."""
        self._waiting.setdefault(ref.key, []).append(request)
        if ref.key not in self._reads:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
            manager = self.manager
            self._reads[ref.key] = (ref, self._executor.submit(load_lora_adapter, ref.path, manager.config,
                                                               manager.max_rank))

    def poll(self) -> tuple[list[T], list[tuple[T, str]]]:
        """Reads that ended since: (requests whose adapter is registered now, (request, error) of those
        whose adapter could not be read or is not the one they were admitted with)."""
        released: list[T] = []
        failed: list[tuple[T, str]] = []
        for key in [k for k, (_, future) in self._reads.items() if future.done()]:
            ref, future = self._reads.pop(key)
            error = self._register(ref, future)
            waiting = self._waiting.pop(key, [])
            if error is None:
                released += waiting
            else:
                failed += [(request, error) for request in waiting]
        return released, failed

    def _register(self, ref: AdapterRef, future: Future) -> str | None:
        try:
            adapter: LoraAdapter = future.result()
        except AdapterError as exc:
            return f"the LoRA adapter {ref.name!r} at {ref.path!r} cannot be served: {exc}"
        except Exception as exc:  # an unexpected read error is the request's, not the worker's
            return f"the LoRA adapter {ref.name!r} at {ref.path!r} could not be read: {exc}"
        if adapter.digest != ref.digest:
            return (f"the LoRA adapter {ref.name!r} at {ref.path!r} has digest {adapter.digest[:12]}, not the "
                    f"{ref.digest[:12]} it was loaded with: its files changed since (load it again)")
        try:
            self.manager.register(ref.key, adapter)
        except AdapterError as exc:
            return f"the LoRA adapter {ref.name!r} cannot be served: {exc}"
        return None

    def take(self, match) -> list[T]:
        """Remove and return the waiting requests for which ``match(request)`` is true (an abort)."""
        taken = []
        for key in list(self._waiting):
            keep = []
            for request in self._waiting[key]:
                (taken if match(request) else keep).append(request)
            if keep:
                self._waiting[key] = keep
            else:
                del self._waiting[key]  # the read goes on: its adapter is registered for later requests
        return taken

    def waiting(self) -> list[T]:
        return [request for requests in self._waiting.values() for request in requests]

    @property
    def num_waiting(self) -> int:
        return sum(len(requests) for requests in self._waiting.values())

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
