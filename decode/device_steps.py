"""The decode worker's steps on the device: launch, with run-ahead feeds, and read back.

``DeviceSteps.launch`` starts a step for a batch of requests; a request whose last token
is still on the device (``num_pending``, sampled by ``previous``) gets it fed from there
(``tandem.engine.step_tokens``). ``read`` waits for one step's tokens; a step counts as done for the
allocator (blocks freed meanwhile go free) only once read. ``stop`` after an engine error.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import structlog
import torch

from tandem.cluster.request_state import banned_token_ids
from tandem.cluster.step_stats import StepStats
from tandem.decode.penalties import DecodePenalties
from tandem.decode.request import DecodeRequest
from tandem.engine.attention import SeqChunk
from tandem.engine import logprobs
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.guide import Guides, apply_bitmask
from tandem.engine.sampler import sample_async
from tandem.engine.step_tokens import StepTokens, TokenFeed

log = structlog.get_logger(__name__)


class DeviceStep(NamedTuple):
    """A decode step on the device."""

    step_id: int
    batch: list[DecodeRequest]
    indices: list[int]  # the output index each row samples
    tokens: StepTokens
    launched_at: float


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

    def launch(self, batch: list[DecodeRequest], previous: DeviceStep | None) -> Exception | None:
        """Start one decode step on the device; its tokens are read by ``read``.

        A request with a token pending in ``previous`` (still on the device) gets it fed
        from there; the others feed their last known token. Returns the engine's error,
        if any: the caller reads ``previous`` before failing the running requests.
        """
        launched = time.perf_counter()
        indices = [len(r.output_token_ids) + r.num_pending for r in batch]
        try:
            rows = {id(r): i for i, r in enumerate(previous.batch)} if previous is not None else {}
            chunks, feed_rows = [], []
            for r in batch:
                if r.num_pending:
                    chunks.append(SeqChunk([0], r.num_tokens, r.block_ids))
                    feed_rows.append(rows[id(r)])  # KeyError: a pending token outside ``previous``
                else:
                    chunks.append(SeqChunk([r.output_token_ids[-1]], r.num_tokens - 1, r.block_ids))
                    feed_rows.append(-1)
            feed = None
            if previous is not None and any(src >= 0 for src in feed_rows):
                feed = TokenFeed(previous.tokens.device_tokens, feed_rows)
            logits = self.runner.forward(chunks, feed)
            raw_logits = logits  # logprobs are the model's own distribution, before any mask
            bitmask = self._guide_masks(batch, previous, rows)  # filled while the forward runs
            if bitmask is not None:
                logits = apply_bitmask(logits, bitmask)
            params = [r.spec.sampling for r in batch]
            banned = None
            if any(p.min_tokens > i for p, i in zip(params, indices)):
                banned = [banned_token_ids(r.spec.sampling, i, r.spec.stop_token_ids, self.eos_token_ids,
                                           r.spec.ignore_eos) for r, i in zip(batch, indices)]
            sample_logits, counting = self.penalties.process(logits, batch, indices, feed)
            sampled = sample_async(sample_logits, params, indices, banned)
            self.penalties.count(counting, sampled)  # on the device: the next step may launch first
            extra = logprobs.compute(raw_logits, sampled, params) if logprobs.wanted(params) else None
            tokens = StepTokens(sampled, extra)
        except Exception as exc:
            return exc
        self._step_seq += 1
        self.allocator.step_launched(self._step_seq)
        for r in batch:
            r.num_pending += 1
        self.in_flight = DeviceStep(self._step_seq, batch, indices, tokens, launched)
        return None

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
        token_ids = step.tokens.wait()
        self.allocator.step_done(step.step_id)
        now = time.perf_counter()
        self.stats.record(len(step.batch), now - step.launched_at, now - self._read_at)
        self._read_at = now
        return token_ids

    def logprob_entries(self, step: DeviceStep) -> list[list | None] | None:
        """After ``read``: one engine.logprobs entry per row of ``step`` (None: no row asked)."""
        host = step.tokens.extra()
        return None if host is None else logprobs.entries(host, [r.spec.sampling for r in step.batch])

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
