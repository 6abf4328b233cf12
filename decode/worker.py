"""Decode worker: one process, one KV pool, continuous batching.

Each step: read the inbox (new requests, prefill results, aborts), reserve
blocks and hand prefill jobs out, check handoffs in flight, run one decode
step over the running batch and publish every new token in one Redis round
trip. Request statuses moved here: see ``decode.scheduler``.
"""

from __future__ import annotations

import os
import tempfile
import time

import redis
import structlog

from cluster import keys
from cluster.admission import Reservations
from cluster.inbox import Inbox, Mailer, send
from cluster.messages import AbortRequest, GenerateRequest, PrefillDone, PrefillJob, TokenEvent, WorkerInfo
from cluster.outputs import Outbox
from cluster.worker_loop import run_steps, worker_info
from cluster.policy import LivePolicies
from cluster.prefix_index import choose_prefill_worker, longest_prefixes
from cluster.draining import accepting, read_marks
from cluster.registry import Heartbeat, live_workers
from cluster.request_state import RequestStatus
from cluster.service import pid_namespace
from cluster.settings import Settings
from cluster.step_stats import StepStats
from decode.batch_wait import BatchWait, shares_gpu
from decode.pool_files import remove_stale_pool_files
from decode.quarantine import Quarantine
from decode.device_steps import DeviceStep, DeviceSteps, run_ahead
from decode.request import DecodeRequest
from decode.scheduler import DecodeScheduler
from decode.window import held_block_ids
from engine.block_allocator import BlockAllocator
from engine.placement import build_runner, device_identity, resolve_device, resolve_transport
from engine.prefix_cache import block_hashes, num_reusable_blocks
from kvtransfer import KVPoll, KVReceiver, get_transport

log = structlog.get_logger(__name__)


PEER_CHECK_INTERVAL_S = 0.5
EARLY_ABORT_TTL_S = 60.0  # how long an abort for a request not (yet) here is remembered
HOLD_POLL_MS = 2  # inbox wait per turn while a step is held (decode.batch_wait)
RECONCILE_INTERVAL_S = 5.0  # how often admission entries of requests never seen are looked for


class DecodeWorker:
    role = "decode"

    def __init__(self, settings: Settings):
        self.settings = settings
        self.worker_id = settings.worker_name(self.role)
        self.redis = redis.Redis.from_url(settings.redis_url)
        transport = resolve_transport(settings.kv_transport, resolve_device(settings.device))
        self.transport = get_transport(transport)
        shm_path = None
        if transport == "shm":
            # the files of earlier runs of this worker that did not stop cleanly (SIGKILL) go first
            remove_stale_pool_files(_shm_dir(), f"tandem-kv-{self.worker_id}-")
            shm_path = os.path.join(_shm_dir(), f"tandem-kv-{self.worker_id}-{os.getpid()}")
        self.runner = build_runner(settings, shm_path=shm_path)
        try:
            self._set_up(settings)
        except BaseException:
            self.runner.kv_pool.close()  # a start that fails leaves no pool file behind
            raise

    def _set_up(self, settings: Settings) -> None:
        if self.runner.device.type == "cuda":
            self.runner.enable_cuda_graphs(settings.max_batch_size, settings.max_seq_len)
        self.kv_endpoint = self.transport.export_pool(self.runner.kv_pool)
        self.allocator = BlockAllocator(self.runner.kv_pool.num_blocks, settings.tokens_per_block)
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
        )
        self.inbox = Inbox(self.redis, keys.inbox(self.role, self.worker_id), self.worker_id)
        self.outbox = Outbox(self.redis)
        self.mailer = Mailer(self.redis)  # aborts for prefill workers, kept across a Redis error
        self._unhandled: list = []  # inbox messages read in a turn that a Redis error cut short
        self.policies = LivePolicies(self.redis, settings)
        self.reservations = Reservations(self.redis, self.worker_id)
        self.reservations.clear()  # a new incarnation holds no admitted request
        self._ended_ids: list[str] = []  # requests gone whose admission is not given back yet
        self._reconciled_at = time.monotonic()
        self.heartbeat = Heartbeat(
            settings.redis_url, self.info, settings.heartbeat_interval_s, settings.heartbeat_ttl_s
        )
        self._started_at = time.time()
        self._device_identity = device_identity(self.runner.device)
        self.batch_wait = BatchWait(settings.decode_batch_wait_ms / 1000.0, settings.max_batch_size)
        self._prefill_workers: list[WorkerInfo] = []
        self._prefill_drain_marks: dict = {}  # worker id -> cluster.draining.Mark
        self._early_aborts: dict[str, float] = {}  # request id -> when an abort came before the request
        # blocks of given-up handoffs a prefill worker that may still run could write (shm, cuda_ipc)
        self.quarantine = Quarantine(settings.transfer_timeout_s)
        self._pid_namespace = pid_namespace()
        self._foreign_prefill: set[str] = set()  # prefill workers of another model, logged once each
        self._peers_checked_at = 0.0
        self._round_robin = 0
        self.stats = StepStats(self.role)
        self.steps = DeviceSteps(self.runner, self.allocator, self.stats)
        self._handoff_seq = 0
        self.run_ahead = run_ahead(settings.decode_run_ahead, self.runner.device, self.scheduler)

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> None:
        """One loop turn. The GPU runs step N+1 while this process publishes step N's
        tokens and does its Redis work. With ``run_ahead`` (CUDA), step N+1 is launched
        before step N's tokens reach the host, its input tokens taken from step N's on the
        device (``engine.step_tokens``): the GPU never waits for this turn's host work.
        Otherwise, or when step N+1 would need to pause a request for room, step N is read
        first, then step N+1 launched.

        Block ownership: blocks freed while a step is on the device (a request that
        ended, was aborted or paused) are held by the allocator until that step is read
        back, so nothing another process writes can land in a block a step still uses.
        """
        policy = self.policies.refresh().capacity_scheduler_policy  # Redis first: an error here loses nothing
        previous = self.steps.in_flight
        ahead = self.run_ahead and previous is not None and self.scheduler.can_schedule_ahead()
        events = [] if ahead else self._collect(previous)
        self.scheduler.set_policy(policy)
        batch, held = self._schedule()
        failure = self.steps.launch(batch, previous) if batch else None
        if ahead:
            events = self._collect(previous)  # read even if the launch failed: its tokens are good
        if failure is not None:
            self._engine_failed(failure)  # its error events queue behind this step's tokens
        self.outbox.flush()  # in order: what an outage kept back, then this turn's events
        self.mailer.flush()
        idle = not batch and not events and not self._busy()
        # holding: wait on the inbox a little (a PrefillDone ends the wait early) instead of spinning
        self._handle_messages(self.inbox.read(block_ms=20 if idle else HOLD_POLL_MS if held else None))
        self._refresh_peers()
        self._dispatch_prefills()
        self._check_handoffs()
        self._release_admissions()
        self.stats.maybe_log(running=self.scheduler.num_running, prefilling=len(self.scheduler.prefilling),
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

    def serve(self, stop) -> None:
        self.heartbeat.start()
        log.info("decode worker ready", worker_id=self.worker_id, num_blocks=self.allocator.num_total,
                 run_ahead=self.run_ahead)
        try:
            run_steps(self.step, stop)
        finally:
            self.heartbeat.stop()
            self.runner.kv_pool.close()

    def info(self) -> WorkerInfo:
        return worker_info(
            self.settings, self.role, self.worker_id, self.inbox.stream, self._started_at,
            num_total_blocks=self.allocator.num_total,
            num_free_blocks=self.allocator.num_free,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_endpoint=self.kv_endpoint,
            capacity_scheduler_policy=self.scheduler.policy.name,
            max_batch_size=self.settings.max_batch_size,
            num_preemptions=self.scheduler.num_preemptions,
            device=self._device_identity,
        )

    # ---- helpers --------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.prefilling or self.scheduler.waiting)

    def _handle_messages(self, messages: list) -> None:
        """Handle what was read (NOACK: nobody delivers it again), after what a Redis error left
        unhandled last turn; a Redis error keeps the messages not yet handled for the next turn."""
        pending, self._unhandled = self._unhandled + messages, []
        for i, msg in enumerate(pending):
            try:
                self._handle(msg)
            except redis.RedisError:
                self._unhandled = pending[i + 1:]
                raise

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            if msg.request_id in self.scheduler.requests:
                log.error("duplicate request id ignored", request_id=msg.request_id)
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
            self.scheduler.add(DecodeRequest(spec=msg, output_token_ids=list(msg.output_token_ids)))
        elif isinstance(msg, PrefillDone):
            self._on_prefill_done(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)  # blocks a step on the device uses are held until it is read
        else:
            log.error("unexpected message", kind=msg.kind)

    def _abort(self, request_id: str) -> None:
        request = self.scheduler.abort(request_id)
        if request is None:
            # not here (yet): the admin API may cancel a request between the gateway's admission
            # and its submission, so its abort arrives first. Remembered for a while.
            now = time.monotonic()
            while self._early_aborts:  # oldest first (insertion order)
                oldest, at = next(iter(self._early_aborts.items()))
                if now - at < EARLY_ABORT_TTL_S:
                    break
                del self._early_aborts[oldest]
            self._early_aborts.pop(request_id, None)
            self._early_aborts[request_id] = now
            return
        # the client's stream ends here (an admin cancel); a gateway that aborted the request
        # itself (client gone, stop string, failover) has let it go and drops the event.
        # Kept, not sent: it goes out with this turn's events (no Redis call here can fail).
        self.outbox.keep([(request.spec.reply_to,
                           TokenEvent(request_id, len(request.output_token_ids), [], "abort"))])
        if request.status is RequestStatus.PREFILLING and request.prefill_worker_id:
            # the prefill worker still writes our blocks: they are freed on its PrefillDone
            self.mailer.send(keys.inbox("prefill", request.prefill_worker_id), AbortRequest(request_id))

    def _on_prefill_done(self, msg: PrefillDone) -> None:
        self.allocator.free(self.quarantine.release_done(msg.request_id, msg.prefill_worker_id))
        request = self.scheduler.prefilling.get(msg.request_id)
        if request is None:
            return  # already failed by timeout; the blocks were freed then
        if msg.prefill_worker_id and msg.prefill_worker_id != request.prefill_worker_id:
            return  # from a worker the request was taken away from (re-dispatched): stale
        ok = msg.status == "ok"
        self._end_handoff(request)
        request.receiver.on_done(ok, msg.error)
        error = None if ok else (msg.error or f"prefill {msg.status}")
        reason = self.scheduler.on_prefill_done(request, msg.first_token if ok else None, error)
        if msg.status == "failed":
            self._publish([(request, len(request.output_token_ids), reason)], error=msg.error)

    def _refresh_peers(self) -> None:
        now = time.monotonic()
        if now - self._peers_checked_at < PEER_CHECK_INTERVAL_S:
            return
        self._peers_checked_at = now
        model = self.settings.model_name  # prefill workers of another model sharing the Redis are not ours
        self._prefill_workers = []
        for w in live_workers(self.redis, "prefill"):
            if w.model == model:
                self._prefill_workers.append(w)
            elif w.worker_id not in self._foreign_prefill:
                self._foreign_prefill.add(w.worker_id)
                log.warning("ignoring a prefill worker that serves another model (give every service the "
                            "same --served-model-name)", prefill_worker_id=w.worker_id, worker_model=w.model,
                            model=model)
        self._prefill_drain_marks = read_marks(self.redis, "prefill")
        self.batch_wait.shared = shares_gpu(self._device_identity, self._prefill_workers)
        alive = {w.worker_id: w.started_at for w in self._prefill_workers}
        self.allocator.free(self.quarantine.release_ended(alive))
        for request in list(self.scheduler.prefilling.values()):
            lost = request.prefill_worker_id
            if lost is None or (lost in alive and alive[lost] == request.prefill_started_at):
                continue  # never handed out (its handoff already failed), or still served by the same process
            # the prefill worker's heartbeat expired, or it restarted under its id (the new process
            # never saw the job: inbox reads are NOACK): redo the prefill. Should it only have
            # missed beats, the abort stops it, and its late PrefillDone is ignored.
            log.warning("prefill worker lost, re-dispatching", request_id=request.request_id,
                        prefill_worker_id=lost)
            self.mailer.send(keys.inbox("prefill", lost), AbortRequest(request.request_id, "re-dispatched"))
            if request.abort_requested:
                request.receiver.fail("prefill worker lost")
            elif lost in alive or self.transport.revoke_stops_writes:
                self._send_prefill_job(request)  # restarted: the old process writes nothing any more
            elif self._hold_blocks_for_redo(request):
                self._send_prefill_job(request)  # into fresh blocks: the lost worker may only be frozen
            else:
                request.receiver.fail("prefill worker lost, and no free blocks to redo the prefill while "
                                      "its first blocks are held")

    def _hold_blocks_for_redo(self, request: DecodeRequest) -> bool:
        """Swap the request's destination blocks for fresh ones and hold the old ones until the
        lost worker is known to be done with them (decode.quarantine); False if none are free."""
        count = len(request.block_ids)
        if self.allocator.num_free < count:
            return False
        self._hold_blocks(request)
        request.block_ids = self.allocator.allocate_blocks(count)
        return True

    def _hold_blocks(self, request: DecodeRequest) -> None:
        """Detach the request's blocks into the quarantine (the scheduler then frees none)."""
        self.quarantine.hold(request.request_id, request.prefill_worker_id, request.prefill_started_at,
                             request.prefill_pid, held_block_ids(request))
        request.block_ids, request.spare_block_ids, request.num_released_blocks = [], [], 0

    def _accepting_prefill_workers(self) -> list[WorkerInfo]:
        return accepting(self._prefill_workers, self._prefill_drain_marks)

    def _dispatch_prefills(self) -> None:
        if not self._accepting_prefill_workers():
            return  # requests wait, holding no blocks, until a prefill worker registers (or is undrained)
        started = self.scheduler.schedule_prefills()
        for request in started:  # every started request is tracked before any Redis call can fail
            request.receiver = KVReceiver(self.settings.transfer_timeout_s)
        for request in started:
            self._send_prefill_job(request)

    def _send_prefill_job(self, request: DecodeRequest) -> None:
        """Hand the request to a prefill worker; if that cannot happen now, its handoff fails (blocks freed).
        Draining workers only take a re-dispatched job, and only when no other worker can."""
        workers = self._accepting_prefill_workers() or self._prefill_workers
        request.receiver = KVReceiver(self.settings.transfer_timeout_s)
        self._end_handoff(request)  # a re-dispatch: the earlier worker's late chunks are refused
        self._handoff_seq += 1  # per worker: a reused request id never meets an old grant
        request.handoff_id = f"{request.request_id}#{self._handoff_seq}"
        request.dispatched_at = time.monotonic()
        self.transport.grant(request.handoff_id, request.block_ids)
        if not workers:
            request.prefill_worker_id = None  # nobody got the job: nobody writes these blocks
            request.receiver.fail("no prefill worker alive")
            return
        try:
            self._round_robin += 1
            target = choose_prefill_worker(workers, self._cached_prefixes(request, workers), self._round_robin)
            request.prefill_worker_id, request.prefill_started_at = target.worker_id, target.started_at
            same_processes = (target.host == os.uname().nodename and target.pid_namespace
                              and target.pid_namespace == self._pid_namespace)  # its pid names its process here
            request.prefill_pid = target.pid if same_processes else None
            send(self.redis, target.inbox, self._prefill_job(request))
        except redis.RedisError as exc:
            request.prefill_worker_id = None  # nobody got the job: nobody writes the blocks
            request.receiver.fail(f"could not hand the request to a prefill worker: {exc}")

    def _prefill_job(self, request: DecodeRequest) -> PrefillJob:
        spec = request.spec
        resume = request.is_resuming  # recompute the KV of all but the last token, which decoding feeds next
        return PrefillJob(
            request_id=spec.request_id,
            prompt_token_ids=spec.prompt_token_ids + request.output_token_ids[:-1] if resume
            else spec.prompt_token_ids,
            sampling=spec.sampling,
            max_tokens=spec.max_tokens,
            dst_block_ids=request.block_ids,
            kv_endpoint=self.kv_endpoint,
            decode_worker_id=self.worker_id,
            stop_token_ids=spec.stop_token_ids,
            ignore_eos=spec.ignore_eos,
            priority=spec.priority,
            arrival_time=spec.arrival_time,
            reply_to=spec.reply_to,
            resume=resume,
            handoff_id=request.handoff_id or "",
        )

    def _cached_prefixes(self, request: DecodeRequest, workers: list[WorkerInfo]) -> dict[str, int]:
        """prefill worker id -> leading full blocks of the prompt it has cached (0 without prefix caching)."""
        if not self.settings.enable_prefix_caching or len(workers) < 2:
            return {w.worker_id: 0 for w in workers}
        prompt, block_size = request.spec.prompt_token_ids, self.settings.tokens_per_block
        hashes = block_hashes(prompt, block_size)[: num_reusable_blocks(len(prompt), block_size)]
        return longest_prefixes(self.redis, [w.worker_id for w in workers], hashes)

    def _check_handoffs(self) -> None:
        for request in list(self.scheduler.prefilling.values()):
            if request.receiver.poll() is KVPoll.FAILED:
                error = request.receiver.error or "kv handoff failed"
                if request.prefill_worker_id:
                    self.mailer.send(keys.inbox("prefill", request.prefill_worker_id),
                                     AbortRequest(request.request_id))
                self._end_handoff(request)  # before the blocks are freed: no late chunk lands in them
                if request.prefill_worker_id and not self.transport.revoke_stops_writes:
                    self._hold_blocks(request)  # the worker may still write them: held, not freed
                reason = self.scheduler.on_prefill_done(request, None, error)
                log.error("kv handoff failed", request_id=request.request_id, error=error)
                if reason != "abort":
                    self._publish([(request, len(request.output_token_ids), reason)], error=error)

    def _end_handoff(self, request: DecodeRequest) -> None:
        if request.handoff_id is not None:
            self.transport.revoke(request.handoff_id)
            request.handoff_id = None

    def _release_admissions(self) -> None:
        """Give back the admission of every request that left (any path); now and then, release leaks."""
        self._ended_ids += self.scheduler.pop_ended()
        if self._ended_ids:
            self.reservations.release(self._ended_ids)
            self._ended_ids = []  # kept on a Redis error: the next step retries
        if time.monotonic() - self._reconciled_at >= RECONCILE_INTERVAL_S:
            self._reconciled_at = time.monotonic()
            leaked = self.reservations.reconcile(set(self.scheduler.requests))
            if leaked:
                log.warning("released admissions of requests never received", request_ids=leaked)

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
        events = self.scheduler.on_step(step.batch, token_ids, step.indices)
        self.outbox.keep(self._token_events(events))
        return events

    def _engine_failed(self, exc: Exception) -> None:
        """On an engine error every running request fails (and frees its blocks)."""
        log.exception("decode step failed")
        self.steps.stop()  # the failed step's kernels may still write the blocks about to be freed
        failed = self.scheduler.fail_running(str(exc))
        self._publish([(r, len(r.output_token_ids), "error") for r in failed], error=str(exc))

    def _publish(self, events: list[tuple[DecodeRequest, int, str | None]], error: str | None = None) -> None:
        """Every event of one step in one round trip."""
        self.outbox.send(self._token_events(events, error))

    @staticmethod
    def _token_events(events: list[tuple[DecodeRequest, int, str | None]], error: str | None = None) -> list:
        queued = []
        for request, index, reason in events:
            new_tokens = request.output_token_ids[index:] if reason != "error" else []
            event = TokenEvent(request.request_id, index, new_tokens, reason, error if reason == "error" else None)
            queued.append((request.spec.reply_to, event))
        return queued


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def main(settings: Settings, stop) -> None:
    DecodeWorker(settings).serve(stop)
