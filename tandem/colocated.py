"""One device, both pools: a worker whose every step carries the running decode rows and
chunks of waiting prompts, under one token budget.

Two processes on one GPU can only take turns on it: a prefill forward of thousands of
tokens holds every decode row for its whole length, and a closed-loop load brings such
waves back again and again. Here one process runs both pools on one KV pool and one copy
of the weights, and each forward is a mixed step (TensorRT-LLM's chunked context with
in-flight batching, vLLM's chunked prefill):

    decode rows (one token each, every running request)  +  prompt chunks (the rest of the budget)

- The two pools keep their own schedulers and policies: the decode side's capacity
  scheduler (``tandem.decode.scheduler``) admits requests and reserves their blocks as it
  does for a prefill worker; the prefill side's chunking scheduler
  (``tandem.prefill.scheduler``, FIRST_COME_FIRST_SERVED or EQUAL_PROGRESS) chooses the
  chunks. Neither imports the other: this module composes them, above both.
- The handoff is a change of ownership, not a copy: a prompt is computed straight into
  the blocks the capacity scheduler reserved for it (``PrefillState.borrowed``), and when
  its last chunk's step is read the request moves to DECODING with its first token.
- The budget is ``--max-num-tokens`` per step: the decode rows take one token each, the
  prompts what is left (at least one block's worth, so a full batch never starves them).
- A step without prompt chunks is a plain decode step (CUDA graphs, run-ahead); a mixed
  step runs eagerly, its decode rows still fed from the previous step on the device.
- With ``--enable-prefix-caching`` a request's reservation starts from the cached blocks of its
  longest cached prefix and its prompt from after them (``tandem.decode.prefix_reuse``); prompt
  blocks are cached as their chunks fill them, a finished request's output blocks as it ends. With
  ``--kv-host-cache-gb`` evicted blocks go on in host memory and come back for a later prompt.
- First tokens are sampled in the step by the same pipeline as the decode rows
  (``tandem.engine.sampling_pipeline``); they go out, in order, with the step's tokens.

``tandem serve --pools auto`` runs this worker when the pools would share a device (one
GPU, or the CPU); ``--pools separate`` keeps the disaggregated prefill and decode workers.
"""

from __future__ import annotations

import structlog

from tandem.cluster.messages import PrefillDone, TokenEvent, WorkerInfo
from tandem.cluster.prefix_index import PrefixIndex
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.settings import Settings
from tandem.decode.device_steps import DeviceStep, PromptRow
from tandem.decode.handoffs import prefill_job
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.worker import DecodeWorker
from tandem.engine.attention import SeqChunk
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.prompt_logprobs import chunk_entries, num_scored, rows_per_slice
from tandem.engine.sampling_pipeline import FirstToken
from tandem.engine.warmup import warm_up_mixed, warm_up_prefill
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler

log = structlog.get_logger(__name__)


class LocalPrefill:
    """The prefill pool inside the worker. For the decode loop it stands where
    ``tandem.decode.handoffs.PrefillHandoffs`` stands for remote prefill workers
    (``refresh_peers``, ``dispatch``, ``check``, ``on_prefill_done``); the mixed step asks it
    for its prompt rows (``rows``) and hands back what a step did (``launched``, ``read``)."""

    def __init__(self, *, settings: Settings, worker_id: str, scheduler: DecodeScheduler, runner, outbox,
                 publish):
        self.settings = settings
        self.worker_id = worker_id
        self.scheduler = scheduler  # the decode side's: admission, reservations, DECODING
        self.runner = runner
        self.outbox = outbox
        self._publish = publish
        self.block_size = scheduler.allocator.block_size
        # with the decode side's prefix cache: each prompt block is cached as its chunk fills it
        self.prefill = PrefillScheduler(scheduler.allocator, max_num_tokens=settings.max_num_tokens,
                                        max_batch_size=settings.max_batch_size,
                                        policy=settings.context_chunking_policy,
                                        prefix_cache=scheduler.prefix.cache)
        self.eos_token_ids = list(runner.config.eos_token_ids)

    # ---- what the decode loop calls (as for remote prefill workers) -------------------
    @property
    def prefill_workers(self) -> list[WorkerInfo]:
        return []  # no peer: this worker computes its prompts itself

    def refresh_peers(self) -> bool:
        return False

    def on_prefill_done(self, msg: PrefillDone) -> None:
        log.warning("PrefillDone for a worker that computes its own prompts; dropped", request_id=msg.request_id)

    def dispatch(self) -> None:
        """Requests the capacity scheduler admits now: their prompts go into the blocks it reserved."""
        for request in self.scheduler.schedule_prefills():
            job = prefill_job(request, self.worker_id, {})
            cached = request.num_cached_tokens  # its prefix's KV is in the blocks already (decode.prefix_reuse)
            self.prefill.add(PrefillState(job=job, block_ids=list(request.block_ids), borrowed=True,
                                          lora_key=request.lora_key, num_computed=cached, num_cached_tokens=cached,
                                          block_hashes=request.block_hashes))

    def check(self) -> None:
        """Prompts whose request was aborted: dropped (a step still on the device keeps their blocks
        until it is read: the allocator holds blocks freed meanwhile)."""
        for request in [r for r in self.scheduler.prefilling.values() if r.abort_requested]:
            state = self.prefill.jobs.get(request.request_id)
            if state is not None:
                self.prefill.finish(state, RequestStatus.ABORTED)
            self.scheduler.on_prefill_done(request, None, "aborted")

    # ---- the mixed step ---------------------------------------------------------------------
    def rows(self, num_decode: int, chunking_policy: str) -> list[PromptRow]:
        """The prompt chunks of the next step: what the budget leaves after ``num_decode`` rows."""
        self.prefill.set_policy(chunking_policy)
        self.prefill.max_num_tokens = max(self.settings.max_num_tokens - num_decode, self.block_size)
        rows = []
        for state, num_tokens in self.prefill.schedule():
            start, job = state.num_computed, state.job
            first = None
            if start + num_tokens == state.num_prompt_tokens and not job.resume and job.max_tokens:
                first = FirstToken(job.sampling, job.prompt_token_ids, job.stop_token_ids, job.ignore_eos)
            chunk = SeqChunk(job.prompt_token_ids[start : start + num_tokens], start, state.block_ids)
            rows.append(PromptRow(chunk, first, state.scores_prompt, owner=state, lora_key=state.lora_key))
        return rows

    def launched(self, rows: list[PromptRow], step: DeviceStep | None, failure: Exception | None) -> None:
        """The step carrying ``rows`` is on the device: their chunks count as computed (the next
        step takes the next ones), and the prompt logprobs of scoring rows are read off the step's
        hidden states. A launch that failed fails their requests."""
        if failure is not None:
            for row in rows:
                self._fail(row.owner, f"prefill failed: {failure}")
            return
        offset, slice_rows = len(step.batch), rows_per_slice(self.runner.config.vocab_size)
        for row in rows:
            state, num_tokens = row.owner, len(row.chunk.token_ids)
            if row.scores:
                start, prompt = row.chunk.num_computed, state.job.prompt_token_ids
                if state.prompt_logprobs is None:
                    state.prompt_logprobs = [None]  # the first prompt token: nothing precedes it
                n = num_scored(start, num_tokens, len(prompt))
                state.prompt_logprobs += chunk_entries(self.runner.compute_logits, step.hidden[offset : offset + n],
                                                       prompt[start + 1 : start + 1 + n],
                                                       state.job.sampling.prompt_logprobs, slice_rows)
            offset += num_tokens
            self.prefill.on_chunk_done(state, num_tokens)

    def read(self, step: DeviceStep, first_tokens: list[int], entries: list) -> None:
        """``step`` was read: each prompt it completed moves to DECODING with its first token
        (kept in the outbox, in order with the step's other tokens); a paused request's
        recomputed KV lets it go on from its last token; a max_tokens 0 prompt ends here."""
        sampled = iter(zip(first_tokens, entries))
        for row in step.prompts:
            state = row.owner
            token_id, entry = next(sampled) if row.first_token is not None else (None, None)
            if row.chunk.seq_len != state.num_prompt_tokens or self.prefill.jobs.get(state.request_id) is not state:
                continue  # not its last chunk, or it ended since (aborted, failed)
            self.prefill.finish(state, RequestStatus.FINISHED)
            request = self.scheduler.prefilling.get(state.request_id)
            if request is None:
                continue
            job = state.job
            if job.resume:
                self.scheduler.on_prefill_done(request, None, None)
            elif not job.max_tokens:  # the prompt only scored: one event, no token
                self.outbox.keep([(job.reply_to, TokenEvent(job.request_id, 0, [], "length",
                                                            num_cached_tokens=state.num_cached_tokens,
                                                            prompt_logprobs=state.prompt_logprobs))])
                self.scheduler.on_prefill_done(request, None, None)
            else:
                reason = self.scheduler.on_prefill_done(request, token_id, None)
                if reason != "abort":  # an aborted request's client had its last event
                    self.outbox.keep([(job.reply_to, TokenEvent(job.request_id, 0, [token_id], reason,
                                                                num_cached_tokens=state.num_cached_tokens,
                                                                logprobs=None if entry is None else [entry],
                                                                prompt_logprobs=state.prompt_logprobs))])

    def fail_all(self, error: str) -> None:
        """An engine error: every prompt in progress fails (its blocks are freed)."""
        for state in list(self.prefill.jobs.values()):
            self._fail(state, error)

    def _fail(self, state: PrefillState, error: str) -> None:
        if self.prefill.jobs.get(state.request_id) is not state:
            return
        self.prefill.finish(state, RequestStatus.FAILED)
        request = self.scheduler.prefilling.get(state.request_id)
        if request is not None:
            reason = self.scheduler.on_prefill_done(request, None, error)
            if reason != "abort":
                self._publish([(request, len(request.output_token_ids), reason)], error)

    @property
    def num_jobs(self) -> int:
        return len(self.prefill.jobs)


class ColocatedWorker(DecodeWorker):
    """A decode worker that computes its own prompts in its steps (``LocalPrefill``). It registers
    as a decode worker: the gateway routes to it, and a request fails over from it, as from any."""

    computes_prompts = True  # the gateway needs no prefill worker beside it
    others_write_pool = False  # only its own steps write its pool: a block freed is free at once

    def _set_up(self, settings: Settings) -> None:
        super()._set_up(settings)
        if self.prefix_cache is not None:  # the gateway admits a prompt where its prefix is cached
            self.prefix_index = PrefixIndex(self.redis, self.worker_id, self.prefix_cache, settings.heartbeat_ttl_s,
                                            settings.heartbeat_interval_s, self.host_tier)
        self.handoffs = LocalPrefill(settings=settings, worker_id=self.worker_id, scheduler=self.scheduler,
                                     runner=self.runner, outbox=self.outbox, publish=self._publish)
        # the prefill attention's compilations happen before traffic, not in a first mixed step
        warm_up_prefill(self.runner, self.allocator, settings.max_num_tokens)
        if self.runner.device.type == "cuda":  # steps with prompt chunks replay graphs, piecewise
            self.runner.enable_mixed_graphs(settings.max_num_tokens)
        # and their decode rows' attention variants compile before traffic too
        warm_up_mixed(self.runner, self.allocator, settings.max_batch_size, settings.max_seq_len,
                      settings.max_num_tokens)

    def _prefix_cache(self, settings: Settings) -> PrefixCache | None:
        """With --enable-prefix-caching: the cache every admission matches first (``decode.prefix_reuse``),
        over the host tier when there is one."""
        if not settings.enable_prefix_caching:
            return None
        return PrefixCache(self.allocator, host_tier=self.host_tier)

    def _prompt_rows(self, num_decode: int) -> list[PromptRow]:
        return self.handoffs.rows(num_decode, self.policies.context_chunking_policy)

    def _prompts_launched(self, prompts: list[PromptRow], failure: Exception | None) -> None:
        step = self.steps.in_flight
        if failure is None and step.batch:
            self.num_mixed_steps += 1
        self.handoffs.launched(prompts, self.steps.in_flight if failure is None else None, failure)

    def _prompts_read(self, step: DeviceStep) -> None:
        self.handoffs.read(step, *self.steps.first_tokens(step))

    def _engine_failed(self, exc: Exception) -> None:
        super()._engine_failed(exc)
        self.handoffs.fail_all(str(exc))


def main(settings: Settings, stop) -> None:
    ColocatedWorker(settings).serve(stop)
