"""Sampling parameters: torch-free, carried on the wire from gateway to workers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
