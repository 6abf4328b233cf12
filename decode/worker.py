"""Decode worker: one process, one KV pool, continuous batching.

Each step: read the inbox (new requests, prefill results, aborts), reserve
blocks and hand prefill jobs out, check handoffs in flight, run one decode
step over the running batch and publish every new token in one Redis round
trip. Request statuses moved here: see ``tandem.decode.scheduler``; the prefill handoff
(dispatch, PrefillDone, lost prefill workers): ``tandem.decode.handoffs``; which requests it
takes and the admissions it gives back: ``tandem.decode.intake``.
"""

from __future__ import annotations

import time

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.admission import Reservations
from tandem.cluster.inbox import Inbox, Mailer, Unreadable
from tandem.cluster.messages import AbortRequest, GenerateRequest, PrefillDone, TokenEvent, WorkerInfo
from tandem.cluster.outputs import Outbox
from tandem.cluster.prefix_index import PrefixIndex
from tandem.cluster.worker_loop import serve_steps, worker_info
from tandem.cluster.live_policies import LivePolicies
from tandem.cluster.registry import Heartbeat
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.settings import Settings
from tandem.cluster.step_stats import StepStats
from tandem.decode.batch_wait import BatchWait, shares_gpu
from tandem.decode.device_steps import DeviceStep, DeviceSteps, PromptRow, run_ahead
from tandem.decode.handoffs import PrefillHandoffs
from tandem.decode.intake import (
    ADMITTED_BATCHES, Admissions, adapters_read, checked_prefill_done, reject, remember_early_abort, request_problem,
)
from tandem.decode.request import DecodeRequest, token_events
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.swap import SwapSpace
from tandem.engine.allocator_counters import allocator_counters
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.guide import Guides
from tandem.engine.caching_allocator import CachingAllocator
from tandem.engine.host_kv_tier import HostKVTier, host_tier_counters, host_tier_info
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.lora_loads import AdapterLoads, AdapterRef
from tandem.engine.runner_factory import build_runner, device_identity, resolve_device, resolve_transport
from tandem.engine.warmup import warm_up_penalties
from tandem.kernels import compile_watch
from tandem.kvtransfer import get_transport
from tandem.kvtransfer.pool_files import new_pool_path, pool_dir

log = structlog.get_logger(__name__)


HOLD_POLL_MS = 2  # inbox wait per turn while a step is held (decode.batch_wait)


class DecodeWorker:
    role = "decode"
    vocab_size: int | None = None  # the model's (set at start): token ids from the inbox must be below it
    computes_prompts = False  # prompts go to prefill workers (tandem.colocated computes its own)
    # prefill workers write its pool: a block freed while a step is on the device waits for the step
    others_write_pool = True
    num_mixed_steps = 0  # steps that carried decode rows and prompt chunks (tandem.colocated)
    lora_loads: AdapterLoads = AdapterLoads(None)  # serving no adapters (set at start with --enable-lora)
    host_tier: HostKVTier | None = None  # --kv-host-cache-gb: swapped-out KV, and what a prefix cache evicts
    prefix_index: PrefixIndex | None = None  # its prefix cache's hashes in Redis (tandem.colocated)

    def __init__(self, settings: Settings):
        self.settings = settings
        self.worker_id = settings.worker_name(self.role)
        self.redis = redis.Redis.from_url(settings.redis_url)
        transport = resolve_transport(settings.kv_transport, resolve_device(settings.device))
        self.transport = get_transport(transport, settings)
        shm_path = None
        if transport == "shm":
            shm_path = new_pool_path(pool_dir(settings.shm_dir), self.worker_id)
        # a split model's ranks keep their pools in files of their own when prefill workers write them
        tp_size = settings.tp_size("colocated" if self.computes_prompts else "decode")
        self.runner = build_runner(settings, shm_path=shm_path, tp_size=tp_size,
                                   shared_ranks=tp_size > 1 and not self.computes_prompts and shm_path is not None)
        self.vocab_size = self.runner.config.vocab_size
        try:
            self._set_up(settings)
        except BaseException:
            self.runner.leave_group()
            self.runner.kv_pool.close()  # a start that fails leaves no pool file behind
            raise

    def _prefix_cache(self, settings: Settings) -> PrefixCache | None:
        """The prefix cache over the worker's pool: none here (prompts are computed by prefill
        workers, which cache them); a worker that computes its own prompts has one."""
        return None

    def _set_up(self, settings: Settings) -> None:
        if self.runner.device.type == "cuda":
            self.runner.enable_cuda_graphs(settings.max_batch_size, settings.max_seq_len)
        warm_up_penalties(self.runner)  # the first penalized request's step does not compile it
        self.kv_endpoint = self.transport.export_pool(self.runner.kv_pool, self.runner.rank_pools)
        self.allocator = BlockAllocator(self.runner.kv_pool.num_blocks, settings.tokens_per_block,
                                        hold_freed=self.others_write_pool)
        # with --kv-host-cache-gb: host memory a paused request's KV waits in (decode.swap), and
        # what a prefix cache evicts
        self.host_tier = None
        if settings.kv_host_cache_gb > 0:
            self.host_tier = HostKVTier(self.runner.kv_pool, int(settings.kv_host_cache_gb * 1e9))
        self.prefix_cache = self._prefix_cache(settings)
        if self.prefix_cache is not None:  # its cached blocks nobody holds count as free
            self.allocator = CachingAllocator(self.allocator, self.prefix_cache)
        if self.allocator.num_total * settings.tokens_per_block < settings.max_seq_len:
            # a request of max_seq_len tokens could never be admitted and would block the queue
            raise ValueError(
                f"decode KV pool holds {self.allocator.num_total * settings.tokens_per_block} tokens, "
                f"less than --max-seq-len {settings.max_seq_len}: lower --max-seq-len or give the pool more memory"
            )
        self.scheduler = DecodeScheduler(
            self.allocator,
            max_batch_size=settings.max_batch_size,
            max_seq_len=settings.max_seq_len,
            eos_token_ids=self.runner.config.eos_token_ids,
            attention_window=self.runner.config.attention_window(),
            policy=settings.capacity_scheduler_policy,
            swap=None if self.host_tier is None else SwapSpace(self.host_tier, settings.tokens_per_block),
            prefix_cache=self.prefix_cache,
            max_loras=settings.max_loras if self.runner.lora is not None else None,
        )
        self.lora_loads = AdapterLoads(self.runner.lora, settings.lora_module_paths())  # reads --lora-modules
        self.inbox = Inbox(self.redis, keys.inbox(self.role, self.worker_id), self.worker_id)
        self.outbox = Outbox(self.redis)
        self.mailer = Mailer(self.redis)  # aborts for prefill workers, kept across a Redis error
        self._unhandled: list = []  # inbox messages read in a turn that a Redis error cut short
        self.policies = LivePolicies(self.redis, settings)
        self.admissions = Admissions(Reservations(self.redis, self.worker_id))
        self._ended_ids: list[str] = []  # requests gone whose admission is not given back yet
        self.heartbeat = Heartbeat(
            settings.redis_url, self.info, settings.heartbeat_interval_s, settings.heartbeat_ttl_s
        )
        self._started_at = time.time()
        self._device_identity = device_identity(self.runner.device)
        self.batch_wait = BatchWait(settings.decode_batch_wait_ms / 1000.0, settings.max_batch_size)
        self._early_aborts: dict[str, float] = {}  # request id -> when an abort came before the request
        self.handoffs = PrefillHandoffs(settings=settings, worker_id=self.worker_id, redis=self.redis,
                                        scheduler=self.scheduler, transport=self.transport,
                                        kv_endpoint=self.kv_endpoint, mailer=self.mailer, publish=self._publish)
        device, tier = self.runner.device, self.host_tier
        self.stats = StepStats(self.role, settings.stats_interval_s,
                               counters=lambda: allocator_counters(device) | host_tier_counters(tier))
        guides = Guides(settings.tokenizer or settings.model, self.runner.config.vocab_size,
                        self.runner.config.eos_token_ids)
        self.steps = DeviceSteps(self.runner, self.allocator, self.stats, self.runner.config.eos_token_ids, guides)
        self.run_ahead = run_ahead(settings.decode_run_ahead, self.runner.device, self.scheduler)

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> None:
        """One loop turn. The GPU runs step N+1 while this process publishes step N's
        tokens and does its Redis work. With ``run_ahead`` (CUDA), step N+1 is launched
        before step N's tokens reach the host, its input tokens taken from step N's on the
        device (``tandem.engine.step_tokens``): the GPU never waits for this turn's host work.
        Otherwise, or when step N+1 would need to pause a request for room, step N is read
        first, then step N+1 launched.

        Block ownership: blocks freed while a step is on the device (a request that
        ended, was aborted or paused) are held by the allocator until that step is read
        back, so nothing another process writes can land in a block a step still uses.
        """
        part = self.stats.phase  # where the turn's time goes (cluster.step_stats)
        with part("policies"):
            policy = self.policies.refresh().capacity_scheduler_policy  # Redis first: an error here loses nothing
        previous = self.steps.in_flight
        ahead = self.run_ahead and previous is not None and self.scheduler.can_schedule_ahead()
        with part("read"):  # its device_wait share: waiting for the step's tokens
            events = [] if ahead else self._collect(previous)
        with part("schedule"):
            self.scheduler.set_policy(policy)
            batch, held = self._schedule()
            prompts = self._prompt_rows(len(batch))
        with part("launch"):
            failure = self.steps.launch(batch, previous, prompts) if batch or prompts else None
            if prompts:
                self._prompts_launched(prompts, failure)
        if ahead:
            with part("read"):
                events = self._collect(previous)  # read even if the launch failed: its tokens are good
        if failure is not None:
            self._engine_failed(failure)  # its error events queue behind this step's tokens
        with part("publish"):  # the turn's token events, one round trip
            self.outbox.flush()  # in order: what an outage kept back, then this turn's events
            self.mailer.flush()
        idle = not batch and not events and not self._busy()
        # before the inbox read: whatever a prefill worker found lost now sent before it died is
        # read below, before dispatch re-dispatches its jobs (a finished one is not computed again)
        if self.handoffs.refresh_peers():
            self.batch_wait.shared = shares_gpu(self._device_identity, self.handoffs.prefill_workers)
        # holding: wait on the inbox a little (a PrefillDone ends the wait early) instead of spinning
        with part("inbox"):  # idle: mostly the wait for a message
            messages = self.inbox.read(block_ms=20 if idle else HOLD_POLL_MS if held else None)
        with part("intake"):  # admissions: prefix matches, host-tier loads, handoffs
            self._handle_messages(messages)
            adapters_read(self.lora_loads, self.scheduler, self._refuse)
            self.handoffs.dispatch()
            self.handoffs.check()
            self._release_admissions()
        with part("upkeep"):
            self.steps.penalties.release(self.scheduler.pop_left_batch())  # their slots of token counts
            if self.host_tier is not None:
                self.host_tier.poll()  # stores that have landed: a load of their slots waits for nothing
            if self.prefix_index is not None:
                self.prefix_index.sync()  # what the gateway routes by (tandem.colocated)
        self.stats.maybe_log(running=self.scheduler.num_running, prefilling=len(self.scheduler.prefilling),
                             loading=len(self.scheduler.loading),
                             waiting=self.scheduler.num_waiting, free_blocks=self.allocator.num_free,
                             holds=self.batch_wait.num_holds)

    def _schedule(self) -> tuple[list[DecodeRequest], bool]:
        """-> (the next step's batch, whether the step is held for requests in prefill)."""
        now = time.monotonic()
        joining = 0  # counted only where a hold can happen: a GPU shared with a prefill worker
        if self.batch_wait.shared:
            joining = self.batch_wait.num_joining(self.scheduler.prefilling.values(), now)
        held = self.batch_wait.hold(self.scheduler.num_running, joining, now)
        return ([] if held else self.scheduler.schedule_decode()), held

    def _prompt_rows(self, num_decode: int) -> list[PromptRow]:
        """Prompt chunks the next step carries after its ``num_decode`` decode rows: none here
        (prompts are computed by prefill workers); a worker running both pools on one device
        computes them in its own steps (``tandem.colocated``)."""
        return []

    def _prompts_launched(self, prompts: list[PromptRow], failure: Exception | None) -> None:
        """After the launch of a step that carries ``prompts`` (``failure``: its error, if any)."""

    def _prompts_read(self, step: DeviceStep) -> None:
        """After ``step`` was read: what it computed of its prompts (their first tokens)."""

    def serve(self, stop) -> None:
        log.info("decode worker ready", worker_id=self.worker_id, num_blocks=self.allocator.num_total,
                 run_ahead=self.run_ahead)
        compile_watch.serving()  # a kernel compiled from here on is a warning: the warm-up missed it
        serve_steps(self, stop)

    def info(self) -> WorkerInfo:
        return worker_info(
            self.settings, self.role, self.worker_id, self.inbox.stream, self._started_at,
            num_total_blocks=self.allocator.num_total,
            num_free_blocks=self.allocator.num_free,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + self.lora_loads.num_waiting,
            kv_endpoint=self.kv_endpoint,
            capacity_scheduler_policy=self.scheduler.policy.name,
            max_batch_size=self.settings.max_batch_size,
            max_admitted=ADMITTED_BATCHES * self.settings.max_batch_size,
            num_preemptions=self.scheduler.num_preemptions,
            num_swaps_out=0 if self.scheduler.swap is None else self.scheduler.swap.num_swapped_out,
            num_swaps_in=0 if self.scheduler.swap is None else self.scheduler.swap.num_swapped_in,
            device=self._device_identity,
            computes_prompts=self.computes_prompts,
            num_mixed_steps=self.num_mixed_steps,
            prefix_device_hits=self.scheduler.prefix.num_device_hit_blocks,
            **host_tier_info(self.host_tier),
        )

    # ---- helpers --------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.prefilling or self.scheduler.loading
                    or self.scheduler.waiting or self.lora_loads.num_waiting)

    def _handle_messages(self, messages: list) -> None:
        """Handle what was read (NOACK: nobody delivers it again), after what a Redis error left
        unhandled last turn; a Redis error keeps the messages not yet handled for the next turn.
        Any other error is the message's: it is logged and the message dropped (its request
        failed), and the worker goes on."""
        pending, self._unhandled = self._unhandled + messages, []
        for i, msg in enumerate(pending):
            try:
                self._handle(msg)
            except redis.RedisError:
                self._unhandled = pending[i + 1:]
                raise
            except Exception as exc:
                log.exception("message handling failed; dropped", kind=msg.kind)
                if isinstance(msg, GenerateRequest) and msg.request_id not in self.scheduler.requests:
                    self._refuse(msg.request_id, msg.reply_to, f"the request could not be taken: {exc}")

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            if msg.request_id in self.scheduler.requests or any(
                    r.request_id == msg.request_id for r in self.lora_loads.waiting()):
                log.error("duplicate request id ignored", request_id=msg.request_id)
                return
            problem = request_problem(msg, self.scheduler.max_seq_len, self.allocator, self.vocab_size, self.lora_loads)
            if problem is not None:
                self._refuse(msg.request_id, msg.reply_to, problem)
                return
            done = len(msg.output_token_ids)
            if self._early_aborts.pop(msg.request_id, None) is not None:
                # cancelled (admin API) between its admission and its submission: it ends at once
                self._ended_ids.append(msg.request_id)
                self.outbox.keep([(msg.reply_to, TokenEvent(msg.request_id, done, [], "abort"))])
                return
            if done and (done >= msg.max_tokens or len(msg.prompt_token_ids) + done >= self.settings.max_seq_len):
                # a resumed request with nothing left to generate here: it ends at once
                self._ended_ids.append(msg.request_id)
                self.outbox.send([(msg.reply_to, TokenEvent(msg.request_id, done, [], "length"))])
                return
            request = DecodeRequest(spec=msg, output_token_ids=list(msg.output_token_ids))
            adapter = AdapterRef.of(msg)
            if adapter is not None:
                request.lora_key = adapter.key
                if not self.lora_loads.ready(adapter):  # read in the background; steps go on meanwhile
                    self.lora_loads.hold(adapter, request)
                    return
            self.scheduler.add(request)
        elif isinstance(msg, PrefillDone):
            self.handoffs.on_prefill_done(checked_prefill_done(msg, self.vocab_size))
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)  # blocks a step on the device uses are held until it is read
        elif isinstance(msg, Unreadable):
            reject(msg, self.scheduler, self._refuse)
        else:
            log.error("unexpected message", kind=msg.kind)

    def _refuse(self, request_id: str, reply_to: str, error: str) -> None:
        """End a request this worker does not take: its client gets the error, its admission is
        given back. Kept, not sent: it goes out with this turn's events."""
        log.error("request refused", request_id=request_id, error=error)
        self._ended_ids.append(request_id)
        self.outbox.keep([(reply_to, TokenEvent(request_id, 0, [], "error", error=error))])

    def _abort(self, request_id: str) -> None:
        for request in self.lora_loads.take(lambda r: r.request_id == request_id):  # its adapter still read
            self._ended_ids.append(request_id)
            self.outbox.keep([(request.spec.reply_to, TokenEvent(request_id, len(request.output_token_ids), [],
                                                                 "abort"))])
            return
        request = self.scheduler.abort(request_id)
        if request is None:
            # not here (yet): the admin API may cancel a request between the gateway's admission
            # and its submission, so its abort arrives first. Remembered for a while.
            remember_early_abort(self._early_aborts, request_id, time.monotonic())
            return
        # the client's stream ends here (an admin cancel); a gateway that aborted the request
        # itself (client gone, stop string, failover) has let it go and drops the event.
        # Kept, not sent: it goes out with this turn's events (no Redis call here can fail).
        self.outbox.keep([(request.spec.reply_to,
                           TokenEvent(request_id, len(request.output_token_ids), [], "abort"))])
        if request.status is RequestStatus.PREFILLING and request.prefill_worker_id:
            # the prefill worker still writes our blocks: they are freed on its PrefillDone
            self.mailer.send(keys.inbox("prefill", request.prefill_worker_id), AbortRequest(request_id))

    def _release_admissions(self) -> None:
        """Give back the admission of every request that left (any path); now and then, release leaks."""
        self._ended_ids += self.scheduler.pop_ended()
        if self._ended_ids:
            self.admissions.release(self._ended_ids)
            self._ended_ids = []  # kept on a Redis error: the next step retries
        self.admissions.reconcile(  # the requests here, and those waiting for their adapter
            lambda: set(self.scheduler.requests) | {r.request_id for r in self.lora_loads.waiting()})

    def _collect(self, step: DeviceStep | None) -> list[tuple[DecodeRequest, int, str | None]]:
        """Tokens of ``step`` (waits for it) -> its events, recorded and kept in the outbox at
        once: a Redis error anywhere in the turn must not lose them. [] when there is none."""
        if step is None:
            self.steps.idle()
            return []
        try:
            token_ids = self.steps.read(step)
        except Exception as exc:
            self._engine_failed(exc)
            return []
        entries = self.steps.logprob_entries(step)
        events = self.scheduler.on_step(step.batch, token_ids, step.indices)
        by_request = None if entries is None else {id(r): e for r, e in zip(step.batch, entries)}
        self.outbox.keep(token_events(events, logprobs=by_request))
        if step.prompts:
            self._prompts_read(step)
        return events

    def _engine_failed(self, exc: Exception) -> None:
        """On an engine error every running request fails (and frees its blocks)."""
        log.exception("decode step failed")
        self.steps.stop()  # the failed step's kernels may still write the blocks about to be freed
        failed = self.scheduler.fail_running(str(exc))
        self._publish([(r, len(r.output_token_ids), "error") for r in failed], error=str(exc))

    def _publish(self, events: list[tuple[DecodeRequest, int, str | None]], error: str | None = None) -> None:
        """Every event of one step in one round trip."""
        self.outbox.send(token_events(events, error))


def main(settings: Settings, stop) -> None:
    DecodeWorker(settings).serve(stop)
