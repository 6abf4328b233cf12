"""The decode worker's steps on the device: launch, with run-ahead feeds, and read back.

``DeviceSteps.launch`` starts a step for a batch of requests; a request whose last token
is still on the device (``num_pending``, sampled by ``previous``) gets it fed from there
(``tandem.engine.step_tokens``). ``read`` waits for one step's tokens; a step counts as done for the
allocator (blocks freed meanwhile go free) only once read. ``stop`` after an engine error.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import structlog
import torch

from tandem.cluster.request_state import banned_token_ids
from tandem.cluster.step_stats import StepStats
from tandem.decode.step_penalties import DecodePenalties
from tandem.decode.request import DecodeRequest
from tandem.engine.attention import SeqChunk
from tandem.engine import logprobs
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.lora_slots import lora_slots
from tandem.engine.guide import Guides
from tandem.engine.sampling_pipeline import FirstToken, sample_first_tokens, sample_rows
from tandem.engine.step_tokens import StepTokens, TokenFeed

log = structlog.get_logger(__name__)


class PromptRow(NamedTuple):
    """A prompt chunk a step carries after its decode rows (a worker running both pools on one
    device: ``tandem.colocated``)."""

    chunk: SeqChunk
    first_token: FirstToken | None  # the prompt's last chunk: the row samples its first output token
    scores: bool = False  # wants its tokens' final hidden states (the prompt's own logprobs)
    owner: object = None  # the caller's record of the prompt
    lora_key: str | None = None  # its LoRA adapter (the worker's LoraManager name)


class DeviceStep(NamedTuple):
    """A step on the device: decode rows, then any prompt chunks."""

    step_id: int
    batch: list[DecodeRequest]
    indices: list[int]  # the output index each row samples
    tokens: StepTokens
    launched_at: float
    prompts: tuple[PromptRow, ...] = ()
    first_tokens: StepTokens | None = None  # of the prompt rows with a first_token, in order
    hidden: torch.Tensor | None = None  # [T, hidden] every new token's final state, when a prompt row scores


class DeviceSteps:
    def __init__(self, runner, allocator: BlockAllocator, stats: StepStats, eos_token_ids=(),
                 guides: Guides | None = None):
        self.runner, self.allocator, self.stats = runner, allocator, stats
        self.eos_token_ids = list(eos_token_ids)  # banned with the stop tokens before min_tokens
        self.guides = guides  # structured outputs (None: a worker that serves none)
        self.penalties = DecodePenalties()  # logit_bias and penalties, with their slots on the device
        self.in_flight: DeviceStep | None = None  # the newest step launched and not read
        self._step_seq = 0
        self._read_at = time.perf_counter()

    def launch(self, batch: list[DecodeRequest], previous: DeviceStep | None,
               prompts: list[PromptRow] = ()) -> Exception | None:
        """Start one step on the device; its tokens are read by ``read``.

        A request with a token pending in ``previous`` (still on the device) gets it fed
        from there; the others feed their last known token. ``prompts``: chunks of prompts
        computed in the same forward, after the decode rows (their first tokens are sampled
        in the step too). Returns the engine's error, if any: the caller reads ``previous``
        before failing the running requests.
        """
        launched = time.perf_counter()
        indices = [len(r.output_token_ids) + r.num_pending for r in batch]
        try:
            rows = {id(r): i for i, r in enumerate(previous.batch)} if previous is not None else {}
            slots = lora_slots(self.runner, [r.lora_key for r in batch] + [p.lora_key for p in prompts])
            chunks, feed_rows = [], []
            for r in batch:
                slot = slots.get(r.lora_key, -1)
                if r.num_pending:
                    chunks.append(SeqChunk([0], r.num_tokens, r.block_ids, slot))
                    feed_rows.append(rows[id(r)])  # KeyError: a pending token outside ``previous``
                else:
                    chunks.append(SeqChunk([r.output_token_ids[-1]], r.num_tokens - 1, r.block_ids, slot))
                    feed_rows.append(-1)
            chunks += [dataclasses.replace(p.chunk, lora_slot=slots[p.lora_key]) if p.lora_key else p.chunk
                       for p in prompts]
            feed = None
            if previous is not None and any(src >= 0 for src in feed_rows):
                feed = TokenFeed(previous.tokens.device_tokens, feed_rows)
            hidden = None
            if any(p.scores for p in prompts):
                logits, hidden = self.runner.forward_hidden(chunks, feed)
            else:
                logits = self.runner.forward(chunks, feed)
            tokens = self._sample_decode(logits[: len(batch)], batch, indices, previous, rows, feed)
            first_tokens = self._sample_first(logits, len(batch), prompts)
        except Exception as exc:
            return exc
        self._step_seq += 1
        self.allocator.step_launched(self._step_seq)
        for r in batch:
            r.num_pending += 1
        self.in_flight = DeviceStep(self._step_seq, batch, indices, tokens, launched, tuple(prompts), first_tokens,
                                    hidden)
        return None

    def _sample_decode(self, logits, batch: list[DecodeRequest], indices: list[int], previous: DeviceStep | None,
                       rows: dict[int, int], feed: TokenFeed | None) -> StepTokens:
        """The decode rows through the sampling pipeline (``tandem.engine.sampling_pipeline``)."""
        if not batch:
            return StepTokens(torch.empty(0, dtype=torch.int64, device=logits.device))
        bitmask = self._guide_masks(batch, previous, rows)  # filled while the forward runs
        params = [r.spec.sampling for r in batch]
        banned = None
        if any(p.min_tokens > i for p, i in zip(params, indices)):
            banned = [banned_token_ids(r.spec.sampling, i, r.spec.stop_token_ids, self.eos_token_ids,
                                       r.spec.ignore_eos) for r, i in zip(batch, indices)]
        counting = None

        def process(out):
            nonlocal counting
            out, counting = self.penalties.process(out, batch, indices, feed)
            return out

        sampled = sample_rows(logits, params, indices, bitmask=bitmask, banned=banned, process=process)
        self.penalties.count(counting, sampled.tokens)  # on the device: the next step may launch first
        return StepTokens(sampled.tokens, sampled.logprobs)

    def _sample_first(self, logits, num_decode: int, prompts: list[PromptRow]) -> StepTokens | None:
        """The first tokens of the prompts this step completes (the same pipeline)."""
        rows = [num_decode + i for i, p in enumerate(prompts) if p.first_token is not None]
        if not rows:
            return None
        firsts = [prompts[i - num_decode].first_token for i in rows]
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        sampled = sample_first_tokens(logits[index], firsts, self.eos_token_ids, self.guides)
        return StepTokens(sampled.tokens, sampled.logprobs)

    def _guide_masks(self, batch: list[DecodeRequest], previous: DeviceStep | None,
                     rows: dict[int, int]) -> "torch.Tensor | None":
        """The step's structured-output bitmask (None: no row is guided). A guided row's guide first
        consumes every token before this step's: its output so far and, when the previous step's
        token is still pending, that token (its step has finished before this one's forward, so the
        wait is for it alone)."""
        if self.guides is None or not any(r.spec.sampling.grammar for r in batch):
            return None
        previous_tokens = None
        guides = []
        for r in batch:
            if not r.spec.sampling.grammar:
                guides.append(None)
                continue
            if r.guide is None:  # new here (handed off, resumed or failed over): replays its output
                r.guide = self.guides.new(r.spec.sampling.grammar, r.output_token_ids)
            pending = []
            if r.num_pending:
                if previous_tokens is None:
                    previous_tokens = previous.tokens.wait()
                pending = [previous_tokens[rows[id(r)]]]
            r.guide.sync(r.output_token_ids, pending)
            guides.append(r.guide)
        return self.guides.bitmask(guides)

    def read(self, step: DeviceStep) -> list[int]:
        """The tokens of ``step`` (waits for it; raises the engine's error)."""
        if self.in_flight is step:
            self.in_flight = None
        started = time.perf_counter()
        token_ids = step.tokens.wait()
        now = time.perf_counter()
        self.stats.add_time("device_wait", now - started)  # the host ahead of the device
        self.allocator.step_done(step.step_id)
        num_tokens = len(step.batch) + sum(len(p.chunk.token_ids) for p in step.prompts)
        self.stats.record(num_tokens, now - step.launched_at, now - self._read_at)
        self._read_at = now
        return token_ids

    def logprob_entries(self, step: DeviceStep) -> list[list | None] | None:
        """After ``read``: one engine.logprobs entry per row of ``step`` (None: no row asked)."""
        host = step.tokens.extra()
        return None if host is None else logprobs.entries(host, [r.spec.sampling for r in step.batch])

    def first_tokens(self, step: DeviceStep) -> tuple[list[int], list[list | None]]:
        """After ``read``: the first tokens ``step`` sampled for the prompts it completed, with
        their logprob entries (None where a row did not ask)."""
        if step.first_tokens is None:
            return [], []
        token_ids = step.first_tokens.wait()
        params = [p.first_token.params for p in step.prompts if p.first_token is not None]
        host = step.first_tokens.extra()
        return token_ids, [None] * len(params) if host is None else logprobs.entries(host, params)

    def idle(self) -> None:
        self._read_at = time.perf_counter()  # an idle turn is not a step's time

    def stop(self) -> None:
        """After an engine error: wait for whatever still runs; no step is on the device after."""
        self.in_flight = None
        if torch.cuda.is_available() and self.runner.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.runner.device)
            except Exception:  # a sticky device error: nothing runs any more either
                log.exception("device sync after a failed step")
        self.allocator.step_done(self._step_seq)


def run_ahead(mode: str, device: torch.device, scheduler) -> bool:
    """Whether steps are launched before the previous step's tokens are read ("auto": on CUDA).

    Not with a sliding window: its block recycling follows the tokens known on the host.
    """
    if scheduler.window is not None:
        return False
    return mode == "on" or (mode == "auto" and device.type == "cuda")
