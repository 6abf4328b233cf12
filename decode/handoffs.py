"""The decode worker's side of the prefill handoff: which prefill workers it hands jobs to,
dispatching and re-dispatching them, their PrefillDone, failed or timed-out handoffs, and the
destination blocks a lost prefill worker may still write (``tandem.decode.quarantine``).

A request's handoff, as this side sees it::

    (scheduler: PREFILLING, blocks reserved)
        --dispatch--> job sent to a prefill worker, its blocks granted on the transport
        --PrefillDone ok--> DECODING (the scheduler admits it)
        --PrefillDone failed / receiver FAILED (timeout, transfer error)--> ended with an error
        --prefill worker lost (its process gone, its heartbeat expired, or restarted)-->
          re-dispatched to any live prefill worker (fresh blocks where the lost one could still
          write the old ones; those wait in the quarantine)

``PrefillHandoffs`` is composed into the decode worker with its collaborators passed in
(Redis, the scheduler and its allocator, the KV transport, the mailer for prefill inboxes,
and ``publish``, which sends a request's events to its gateway); the decode loop calls
``refresh_peers``, ``dispatch`` and ``check`` once a turn and ``on_prefill_done`` per reply.

A lost prefill worker is found by ``refresh_peers``: its record gone or naming another run
(the registry, re-read every PEER_CHECK_INTERVAL_S), or its process gone (its liveness
subscription, checked every LIVENESS_CHECK_INTERVAL_S: ``tandem.cluster.liveness``), so within
about 1.5 heartbeat intervals of its death rather than the heartbeat's TTL. Its jobs are
re-dispatched by the next ``dispatch``, which the loop calls after that turn's inbox read:
everything the dead process sent was in the inbox before its death was seen, so a request it
already finished (its PrefillDone read) keeps its first token and goes on decoding instead of
being computed again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.draining import accepting, read_marks
from tandem.cluster.inbox import Mailer, send
from tandem.cluster.liveness import ended_runs
from tandem.cluster.messages import AbortRequest, PrefillDone, PrefillJob, WorkerInfo
from tandem.cluster.prefix_index import choose_prefill_worker, longest_prefixes
from tandem.cluster.registry import live_workers, of_model
from tandem.cluster.process import pid_namespace, process_exists
from tandem.cluster.settings import Settings
from tandem.decode.quarantine import Quarantine
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.window import held_block_ids
from tandem.cluster.block_hashes import block_hashes, num_reusable_blocks
from tandem.kvtransfer import KVPoll, KVReceiver, Transport

log = structlog.get_logger(__name__)

PEER_CHECK_INTERVAL_S = 0.5  # the registry's records (a SCAN over the keyspace)
LIVENESS_CHECK_INTERVAL_S = 0.1  # the known prefill workers' liveness (one round trip)


# (request, output index, finish reason) events, and the error they carry
Publish = Callable[[list[tuple[DecodeRequest, int, "str | None"]], "str | None"], None]


class PrefillHandoffs:
    def __init__(self, *, settings: Settings, worker_id: str, redis: redis.Redis, scheduler: DecodeScheduler,
                 transport: Transport, kv_endpoint: dict, mailer: Mailer, publish: Publish):
        self.settings = settings
        self.worker_id = worker_id
        self.redis = redis
        self.scheduler = scheduler
        self.allocator = scheduler.allocator
        self.transport = transport
        self.kv_endpoint = kv_endpoint  # where prefill workers reach our pool
        self.mailer = mailer  # aborts for prefill workers, kept across a Redis error
        self._publish = publish
        self._registered: list[WorkerInfo] = []  # prefill workers with a record, serving our model
        self._ended: set[tuple[str, float]] = set()  # (id, started_at) of those whose process is gone (last probe)
        self._marks: dict = {}  # drain marks of the prefill workers
        self._prefill_workers: list[WorkerInfo] = []  # live: registered, their process not gone
        self._taking_prefill_workers: list[WorkerInfo] = []  # of those, the ones not being drained
        self._foreign_prefill: set[tuple[str, str]] = set()  # workers of another model, logged once
        self._peers_checked_at = 0.0
        self._liveness_checked_at = 0.0
        self._peers_changed = False  # the live prefill workers were re-derived: look for lost jobs
        self._round_robin = 0
        self._handoff_seq = 0
        # blocks of given-up handoffs a prefill worker that may still run could write (shm, cuda_ipc)
        self.quarantine = Quarantine(settings.transfer_timeout_s)
        self._pid_namespace = pid_namespace()
        # re-dispatches that found no live prefill worker: sent once one is back (a restarted lone
        # prefill worker), within the receiver's deadline (--transfer-timeout-s)
        self._undispatched: list[DecodeRequest] = []

    @property
    def prefill_workers(self) -> list[WorkerInfo]:
        """The live prefill workers serving our model (as of the last refresh)."""
        return self._prefill_workers

    def on_prefill_done(self, msg: PrefillDone) -> None:
        self.allocator.free(self.quarantine.release_done(msg.request_id, msg.prefill_worker_id))
        request = self.scheduler.prefilling.get(msg.request_id)
        if request is None:
            return  # already failed by timeout; the blocks were freed then
        if msg.prefill_worker_id and msg.prefill_worker_id != request.prefill_worker_id:
            return  # from a worker the request was taken away from (re-dispatched): stale
        if msg.handoff_id and msg.handoff_id != request.dispatch_id:
            return  # from an earlier dispatch to the same worker (the request came back to it): stale
        ok = msg.status == "ok"
        self._end_handoff(request)
        request.receiver.on_done(ok, msg.error)
        error = None if ok else (msg.error or f"prefill {msg.status}")
        reason = self.scheduler.on_prefill_done(request, msg.first_token if ok else None, error)
        if msg.status == "failed":
            self._publish([(request, len(request.output_token_ids), reason)], msg.error)

    def refresh_peers(self) -> bool:
        """Re-read the prefill workers' records (at most every PEER_CHECK_INTERVAL_S) and check
        that their processes live (every LIVENESS_CHECK_INTERVAL_S); True when the live ones were
        derived anew. The jobs of lost ones wait for ``redispatch_lost`` (``dispatch``)."""
        now = time.monotonic()
        # while re-dispatches wait for a prefill worker (a lone one restarting), at the probe's pace
        reread = now - self._peers_checked_at >= (LIVENESS_CHECK_INTERVAL_S if self._undispatched
                                                  else PEER_CHECK_INTERVAL_S)
        if not reread and now - self._liveness_checked_at < LIVENESS_CHECK_INTERVAL_S:
            return False
        if reread:
            self._peers_checked_at = now
            self._registered = of_model(live_workers(self.redis, "prefill"), self.settings.model_name,
                                        self._foreign_prefill)
            self._marks = read_marks(self.redis, "prefill")
        self._liveness_checked_at = now
        self._ended = ended_runs(self.redis, "prefill", self._registered)
        self._prefill_workers = [w for w in self._registered if (w.worker_id, w.started_at) not in self._ended]
        # derived here, where it changes, not on every step
        self._taking_prefill_workers = accepting(self._prefill_workers, self._marks)
        self._peers_changed = True
        return True

    def redispatch_lost(self) -> None:
        """Send the jobs of lost prefill workers to live ones (called after the turn's inbox read:
        a reply the lost worker sent before it died has been handled, and its request is done)."""
        if not self._peers_changed:
            return
        self._peers_changed = False
        alive = {w.worker_id: w.started_at for w in self._prefill_workers}
        self.allocator.free(self.quarantine.release_ended(alive))
        for request in list(self.scheduler.prefilling.values()):
            lost = request.prefill_worker_id
            if lost is None or (lost in alive and alive[lost] == request.prefill_started_at):
                continue  # never handed out (its handoff already failed), or still served by the same process
            # its process is gone, its heartbeat expired, or it restarted under its id (the new
            # process never saw the job: inbox reads are NOACK): redo the prefill. Should it only
            # have missed beats, the abort stops it, and its late PrefillDone is ignored.
            restarted = lost in alive
            log.warning("prefill worker lost, re-dispatching", request_id=request.request_id,
                        prefill_worker_id=lost, restarted=restarted)
            self.mailer.send(keys.inbox("prefill", lost), AbortRequest(request.request_id, "re-dispatched"))
            ended = restarted or (request.prefill_pid is not None and not process_exists(request.prefill_pid))
            if request.abort_requested:
                request.receiver.fail("prefill worker lost")
            elif ended or self.transport.revoke_stops_writes:
                self._send_prefill_job(request)  # its old process writes nothing any more
            elif self._hold_blocks_for_redo(request):
                self._send_prefill_job(request)  # into fresh blocks: the lost worker may only be frozen
            else:
                request.receiver.fail("prefill worker lost, and no free blocks to redo the prefill while "
                                      "its first blocks are held")

    def _hold_blocks_for_redo(self, request: DecodeRequest) -> bool:
        """Swap the request's destination blocks for fresh ones and hold the old ones until the
        lost worker is known to be done with them (the quarantine); False if none are free."""
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

    def dispatch(self) -> None:
        """Re-dispatch the jobs of lost prefill workers, then hand the requests the scheduler
        starts now to prefill workers."""
        self.redispatch_lost()
        if not self._taking_prefill_workers:
            return  # requests wait, holding no blocks, until a prefill worker registers (or is undrained)
        waiting, self._undispatched = self._undispatched, []
        for request in waiting:
            if request.request_id in self.scheduler.prefilling and request.prefill_worker_id is None:
                self._send_prefill_job(request, fresh_deadline=False)
        started = self.scheduler.schedule_prefills()
        for request in started:  # every started request is tracked before any Redis call can fail
            request.receiver = KVReceiver(self.settings.transfer_timeout_s)
        for request in started:
            self._send_prefill_job(request)

    def _send_prefill_job(self, request: DecodeRequest, fresh_deadline: bool = True) -> None:
        """Hand the request to a prefill worker; with none alive it waits for one (within its
        receiver's deadline); if the send fails, its handoff fails (blocks freed). Draining
        workers only take a re-dispatched job, and only when no other worker can."""
        workers = self._taking_prefill_workers or self._prefill_workers
        if fresh_deadline or request.receiver is None:
            request.receiver = KVReceiver(self.settings.transfer_timeout_s)
        self._end_handoff(request)  # a re-dispatch: the earlier worker's late chunks are refused
        self._handoff_seq += 1  # per worker: a reused request id never meets an old grant
        request.handoff_id = request.dispatch_id = f"{request.request_id}#{self._handoff_seq}"
        request.dispatched_at = time.monotonic()
        self.transport.grant(request.handoff_id, request.block_ids)
        if not workers:
            request.prefill_worker_id = None  # nobody got the job: nobody writes these blocks
            self._undispatched.append(request)
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
        return prefill_job(request, self.worker_id, self.kv_endpoint)

    def _cached_prefixes(self, request: DecodeRequest, workers: list[WorkerInfo]) -> dict[str, int]:
        """prefill worker id -> leading full blocks of the prompt it has cached (0 without prefix caching)."""
        if not self.settings.enable_prefix_caching or len(workers) < 2:
            return {w.worker_id: 0 for w in workers}
        prompt, block_size = request.spec.prompt_token_ids, self.settings.tokens_per_block
        hashes = block_hashes(prompt, block_size, salt=request.spec.lora_digest)[
            : num_reusable_blocks(len(prompt), block_size)]
        return longest_prefixes(self.redis, [w.worker_id for w in workers], hashes)

    def check(self) -> None:
        """End the handoffs that failed (transfer error or timeout)."""
        for request in list(self.scheduler.prefilling.values()):
            if request.receiver.poll() is KVPoll.FAILED:
                error = request.receiver.error or "kv handoff failed"
                if request in self._undispatched:
                    self._undispatched.remove(request)
                    error = "no prefill worker was alive to compute the prompt within --transfer-timeout-s"
                if request.prefill_worker_id:
                    self.mailer.send(keys.inbox("prefill", request.prefill_worker_id),
                                     AbortRequest(request.request_id))
                self._end_handoff(request)  # before the blocks are freed: no late chunk lands in them
                if request.prefill_worker_id and not self.transport.revoke_stops_writes:
                    self._hold_blocks(request)  # the worker may still write them: held, not freed
                reason = self.scheduler.on_prefill_done(request, None, error)
                log.error("kv handoff failed", request_id=request.request_id, error=error)
                if reason != "abort":
                    self._publish([(request, len(request.output_token_ids), reason)], error)

    def _end_handoff(self, request: DecodeRequest) -> None:
        if request.handoff_id is not None:
            self.transport.revoke(request.handoff_id)
            request.handoff_id = None


def prefill_job(request: DecodeRequest, worker_id: str, kv_endpoint: dict) -> PrefillJob:
    """The job that computes a request's prompt into its reserved blocks (a paused one's prompt
    and output but the last token: its KV is recomputed, no first token sampled)."""
    spec = request.spec
    resume = request.is_resuming
    return PrefillJob(
        request_id=spec.request_id,
        prompt_token_ids=request.prefill_token_ids,
        sampling=spec.sampling,
        max_tokens=spec.max_tokens,
        dst_block_ids=request.block_ids,
        kv_endpoint=kv_endpoint,
        decode_worker_id=worker_id,
        stop_token_ids=spec.stop_token_ids,
        ignore_eos=spec.ignore_eos,
        priority=spec.priority,
        arrival_time=spec.arrival_time,
        reply_to=spec.reply_to,
        resume=resume,
        handoff_id=request.handoff_id or "",
        lora_name=spec.lora_name,
        lora_path=spec.lora_path,
        lora_digest=spec.lora_digest,
    )
