"""Sampling parameters: torch-free, carried on the wire from gateway to workers.

Besides temperature, top-k and top-p, a request can ask for the logits to be processed
before sampling, in this order (the order vLLM and HF transformers apply them in):
the structured-output mask (``grammar``), ``logit_bias``, ``repetition_penalty`` (HF's:
over prompt and output), ``frequency_penalty`` and ``presence_penalty`` (OpenAI's:
over the output), then temperature, top-k, top-p and ``min_p``. Logprobs stay the
model's own distribution (vLLM's default), before any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (as vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request (OpenAI allows 300)
PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
BIAS_RANGE = 100.0  # a logit bias lies in [-100, 100], as OpenAI's


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's log-probability and the k most likely
    min_tokens: int = 0  # no EOS or stop token (nor stop string) ends the output before this many tokens
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages any token of prompt or output (HF's rule)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    # an llguidance grammar (tandem.gateway.guided made and checked it): only tokens it allows
    grammar: str | None = None
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the tokens seen so far (per-request counts on the device)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether logits are changed before temperature (penalties or biases)."""
        return self.penalized or bool(self.logit_bias)
