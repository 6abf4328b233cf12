"""Which adapters a worker serves, which of them are in host memory, which in device slots.

- ``add(name, path)`` reads and checks a PEFT adapter (engine.lora_adapter) and registers it
  under ``name``; a failed add changes nothing. Its weights stay in host memory, at most
  ``max_cpu_loras`` adapters' worth (least recently used dropped first); a dropped one is read
  again from its path when next needed, and must have the digest it was added with.
- ``slots_for(names)``: before a step, the device slot of each adapter the step uses. An
  adapter already in a slot keeps it; one that is not takes a free slot, else the least
  recently used slot whose adapter the step does not use, and is copied into it
  (``LoraWeights.write``: no other slot changes). At most ``max_loras`` adapters per step.
- ``remove(name)`` forgets an adapter; its slot becomes free (the caller stops scheduling
  its rows first).

Every name a chunk's slot stands for is resolved here; the runner sees only slots
(``SeqChunk.lora_slot``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.engine.config import ModelConfig
from tandem.engine.lora_adapter import AdapterError, LoraAdapter, load_lora_adapter
from tandem.engine.lora_weights import LoraWeights


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    digest: str
    rank: int


class LoraManager:
    def __init__(self, weights: LoraWeights, config: ModelConfig, max_cpu_loras: int) -> None:
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be positive, not {max_cpu_loras}")
        self.weights, self.config, self.max_cpu_loras = weights, config, max_cpu_loras
        self._info: dict[str, AdapterInfo] = {}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first

    @property
    def max_loras(self) -> int:
        return self.weights.max_loras

    @property
    def max_rank(self) -> int:
        return self.weights.max_rank

    def add(self, name: str, path: str | os.PathLike) -> AdapterInfo:
        """Read, check and register the adapter at ``path`` as ``name``. Adding a name again with
        the same path and weights is a no-op; with others, an ``AdapterError``."""
        return self.register(name, load_lora_adapter(os.fspath(path), self.config, self.max_rank))

    def register(self, name: str, adapter: LoraAdapter) -> AdapterInfo:
        """Register an adapter already read and checked (``load_lora_adapter`` with this manager's
        config and maximum rank, off the step loop: ``engine.lora_loads``) as ``name``; the same
        rules as ``add``."""
        if adapter.rank > self.max_rank:
            raise AdapterError("rank", f"rank {adapter.rank} is above the maximum LoRA rank {self.max_rank}")
        known = self._info.get(name)
        if known is not None:
            if known.path == adapter.path and known.digest == adapter.digest:
                return known
            raise AdapterError("name", f"an adapter named {name!r} is already loaded (from {known.path!r})")
        info = AdapterInfo(name, adapter.path, adapter.digest, adapter.rank)
        self._info[name] = info
        self._keep_on_host(name, adapter)
        return info

    def remove(self, name: str) -> None:
        """Forget ``name`` (KeyError if unknown); its slot, if any, is freed."""
        del self._info[name]
        self._host.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self.weights.clear(slot)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def info(self, name: str) -> AdapterInfo:
        return self._info[name]

    def names(self) -> list[str]:
        return list(self._info)

    def slot_of(self, name: str) -> int | None:
        """The device slot holding ``name``, or None."""
        return self._slot_of.get(name)

    def on_host(self, name: str) -> bool:
        return name in self._host

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """name -> device slot for every adapter a step uses, copying the ones not in a slot
        into free or least recently used slots the step does not use (module docstring)."""
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in self._info]
        if unknown:
            raise KeyError(f"unknown LoRA adapters: {unknown}")
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} adapters; the device holds {self.max_loras}")
        for name in wanted:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
        for name in wanted:
            if name not in self._slot_of:
                adapter = self._adapter(name)  # before evicting: a failed read changes no slot
                slot = self._free_slot(set(wanted))
                self.weights.write(slot, adapter)
                self._slot_of[name] = slot
        return {name: self._slot_of[name] for name in wanted}

    def _free_slot(self, in_use: set[str]) -> int:
        taken = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            return free[0]
        victim = next(n for n in self._slot_of if n not in in_use)  # least recently used first
        return self._slot_of.pop(victim)

    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is not None:
            self._host.move_to_end(name)
            return adapter
        info = self._info[name]
        adapter = load_lora_adapter(info.path, self.config, self.max_rank)
        if adapter.digest != info.digest:
            raise AdapterError("file", f"adapter {name!r} at {info.path!r} changed since it was loaded "
                                       f"(digest {adapter.digest[:12]}, was {info.digest[:12]})")
        self._keep_on_host(name, adapter)
        return adapter

    def _keep_on_host(self, name: str, adapter: LoraAdapter) -> None:
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
