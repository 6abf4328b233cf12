"""The ``n`` choices of one request: one ``Generation`` each, run side by side.

With n > 1 choice i is its own request on the workers (wire id ``<request_id>-<i>``,
admitted and failed over on its own) and, when the request is seeded, samples with
seed + i, so the choices differ and each is reproducible. Greedy choices are
identical, as in vLLM and OpenAI. ``deltas()`` merges the choices' deltas as they
come, tagged with the choice index; the first error of any choice ends the whole
request (``close()`` aborts every choice still running on the workers).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tandem.gateway.generation import Generation
from tandem.gateway.responses import ChoiceResult, Delta, Usage

_END = object()  # a choice's pump is done


class Choices:
    def __init__(self, request_id: str, generations: list[Generation]):
        self.request_id = request_id  # what the client sees
        self.generations = generations

    @property
    def n(self) -> int:
        return len(self.generations)

    @property
    def created(self) -> int:
        return self.generations[0].created

    @property
    def usage(self) -> Usage:
        """The prompt counts once (as in vLLM and OpenAI); the completions add up."""
        first = self.generations[0].usage
        return Usage(first.prompt_tokens, sum(g.usage.completion_tokens for g in self.generations),
                     first.cached_tokens)

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice has ended."""
        if self.n == 1:
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
            remaining = self.n
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
        return [ChoiceResult(text, token_ids, g.finish_reason,
                             g.output_logprobs if g.input.sampling.logprobs is not None else None)
                for (text, token_ids), g in zip(results, self.generations)]

    def close(self) -> None:
        for generation in self.generations:
            generation.close()
