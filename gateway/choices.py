"""The ``n`` choices of one request's every prompt: one ``Generation`` each, run side by side.

With n > 1 choice i is its own request on the workers (wire id ``<request_id>-<i>``,
admitted and failed over on its own) and, when the request is seeded, samples with
seed + i, so the choices differ and each is reproducible. Greedy choices are
identical, as in vLLM and OpenAI. ``deltas()`` merges the choices' deltas as they
come, tagged with the choice index; the first error of any choice ends the whole
request (``close()`` aborts every choice still running on the workers).

best_of > n (not streamed): best_of sequences are sampled, each a generation as a choice
is (sequence i seeded with seed + i), all asking for their tokens' logprobs; ``collect``
waits for all and returns the n with the highest cumulative logprob (the sum of their
sampled tokens' logprobs; ties: the lower index), indexed 0..n-1, their logprobs dropped
when the client did not ask for them. Usage counts every sequence's tokens, as vLLM and
OpenAI bill best_of.

A batch of prompts (/v1/completions' prompt as a list) has each prompt's sequences one after
the other, prompt by prompt: prompt p's choice i is the response's choice p * n + i (as in
OpenAI's legacy API and vLLM), best_of picks each prompt's best among its own, and usage counts
each prompt once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from tandem.gateway.generation import Generation
from tandem.gateway.responses import ChoiceResult, Delta, Usage

_END = object()  # a choice's pump is done


class Choices:
    def __init__(self, request_id: str, generations: list[Generation], n: int | None = None,
                 logprobs_asked: bool = True, num_prompts: int = 1):
        """``generations``: the sequences sampled, ``num_prompts`` groups of as many each, prompt
        by prompt (best_of of them when more than ``n``, the choices returned of each prompt);
        ``logprobs_asked``: whether the client asked for logprobs (best_of asks for them on its own)."""
        self.request_id = request_id  # what the client sees
        self.generations = generations
        self.num_prompts = num_prompts
        self.per_prompt = len(generations) // num_prompts  # sequences of each prompt
        self._n = self.per_prompt if n is None else n
        self._logprobs_asked = logprobs_asked

    @property
    def n(self) -> int:
        """The choices returned, of all prompts."""
        return self._n * self.num_prompts

    @property
    def created(self) -> int:
        return self.generations[0].created

    @property
    def usage(self) -> Usage:
        """Each prompt counts once (as in vLLM and OpenAI); the completions add up."""
        firsts = [g.usage for g in self.generations[::self.per_prompt]]  # each prompt's first sequence
        return Usage(sum(u.prompt_tokens for u in firsts), sum(g.usage.completion_tokens for g in self.generations),
                     sum(u.cached_tokens for u in firsts))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice has ended (streams: best_of is n)."""
        if len(self.generations) == 1:
            async for delta in self.generations[0].deltas():
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for delta in generation.deltas():
                    await queue.put((index, delta))
                await queue.put((index, _END))
            except Exception as exc:  # handed to the reader, which raises it
                await queue.put((index, exc))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            remaining = len(self.generations)
            while remaining:
                index, item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    async def collect(self) -> list[ChoiceResult]:
        """Run every choice to its end."""
        tasks = [asyncio.ensure_future(g.collect()) for g in self.generations]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # one failed (or the client left): the others stop too
        sequences = [ChoiceResult(text, token_ids, g.finish_reason,
                                  g.output_logprobs if g.input.sampling.logprobs is not None else None, g.prompt)
                     for (text, token_ids), g in zip(results, self.generations)]
        k = self.per_prompt
        choices = [choice for i in range(0, len(sequences), k)
                   for choice in (best_of(sequences[i:i + k], self._n) if k > self._n else sequences[i:i + k])]
        if not self._logprobs_asked:
            choices = [replace(choice, logprobs=None) for choice in choices]
        return choices

    def close(self) -> None:
        for generation in self.generations:
            generation.close()


def cumulative_logprob(choice: ChoiceResult) -> float:
    """The sum of a sequence's sampled tokens' logprobs (a token without an entry adds nothing)."""
    return sum(entry[0] for entry in choice.logprobs or [] if entry is not None)


def best_of(choices: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """The ``n`` choices of highest cumulative logprob, best first (ties: the lower index)."""
    ranked = sorted(range(len(choices)), key=lambda i: (-cumulative_logprob(choices[i]), i))
    return [choices[i] for i in ranked[:n]]
