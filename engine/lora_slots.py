"""How many LoRA adapters a batch may name together (the device holds ``max_loras``), and the
slots a step's rows take.

A scheduler admits requests so that the requests it has admitted (and whose rows any step may
carry) name at most ``max_loras`` adapters; every step's adapters then fit the device slots
(``engine.lora_manager.LoraManager.slots_for``). Requests of no adapter are never held back.
A request whose adapter would be one too many is passed over, and from then on only requests of
no adapter pass it too (``admits``): the admitted adapters' requests drain and its adapter gets
its turn, instead of waiting behind a stream of requests for adapters already admitted.
"""

from __future__ import annotations

from collections.abc import Iterable


class AdapterSlots:
    def __init__(self, max_loras: int | None, *admitted: Iterable) -> None:
        """``admitted``: the requests already admitted (anything with ``lora_key``)."""
        self.max_loras = max_loras
        self.keys = {r.lora_key for group in admitted for r in group if r.lora_key}
        self.passed_over = False

    def admits(self, lora_key: str | None) -> bool:
        """Whether a request of ``lora_key`` (None: no adapter) may be admitted now."""
        if lora_key is None or self.max_loras is None:
            return True
        if not self.passed_over and (lora_key in self.keys or len(self.keys) < self.max_loras):
            return True
        self.passed_over = True
        return False

    def add(self, lora_key: str | None) -> None:
        if lora_key is not None:
            self.keys.add(lora_key)


def lora_slots(runner, lora_keys: list[str | None]) -> dict[str, int]:
    """The device slot of each LoRA adapter a step's rows name (None: no adapter), copying cold ones
    into slots first (``engine.lora_manager``); {} when no row names one."""
    named = [key for key in lora_keys if key]
    if not named:
        return {}
    if runner.lora is None:
        raise ValueError("a row names a LoRA adapter but this worker serves none")
    return runner.lora.slots_for(named)
