"""Sampling parameters: torch-free, carried on the wire from gateway to workers."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (as vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's log-probability and the k most likely
    min_tokens: int = 0  # no EOS or stop token (nor stop string) ends the output before this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
