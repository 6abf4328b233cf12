"""Prefill worker: one process, its own KV pool, chunked prefill.

Each step: read the inbox (jobs, aborts), run one forward over the chunks the
scheduler picked (at most ``max_num_tokens`` tokens), push each chunk's blocks
into the decode worker's destination blocks, sample and publish the first
token of every prompt that completed (TTFT does not wait for the decode
worker), and report finished handoffs with PrefillDone (before the first token
when the writes are already in place, as they are with a synchronous transport:
a request whose client has its first token is then never computed again when
this worker dies). Statuses moved here: see ``tandem.prefill.scheduler``; the forward
and what comes of it (prompt logprobs, first tokens, a max_tokens 0 job's one event):
``tandem.prefill.chunk_forward``.
"""

from __future__ import annotations

import time

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.inbox import Inbox, Mailer, Unreadable
from tandem.cluster.messages import AbortRequest, PrefillDone, PrefillJob, WorkerInfo, named
from tandem.cluster.outputs import Outbox
from tandem.cluster.worker_loop import serve_steps, worker_info
from tandem.cluster.live_policies import LivePolicies
from tandem.cluster.prefix_index import PrefixIndex
from tandem.cluster.registry import Heartbeat
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.settings import Settings
from tandem.cluster.step_stats import StepStats
from tandem.engine.allocator_counters import allocator_counters
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.warmup import warm_up_mixed, warm_up_penalties, warm_up_prefill
from tandem.engine.runner_factory import build_runner, device_identity, resolve_device, resolve_transport
from tandem.engine.host_kv_tier import HostKVTier, host_tier_counters, host_tier_info
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.guide import Guides
from tandem.engine.lora_loads import AdapterLoads, AdapterRef
from tandem.kernels import compile_watch
from tandem.kvtransfer import KVPoll, KVSender, get_transport
from tandem.kvtransfer.base import TransferError
from tandem.kvtransfer.pool_files import new_pool_path, pool_dir
from tandem.prefill.chunk_forward import chunks_done, first_token_events, run_chunks
from tandem.prefill.job import PrefillState
from tandem.prefill.job_checks import job_problem
from tandem.prefill.scheduler import PrefillScheduler

log = structlog.get_logger(__name__)


class PrefillWorker:
    role = "prefill"
    lora_loads: AdapterLoads = AdapterLoads(None)  # serving no adapters (set at start with --enable-lora)
    host_tier: HostKVTier | None = None  # blocks the prefix cache evicts, kept in host memory (--kv-host-cache-gb)

    def __init__(self, settings: Settings):
        self.settings = settings
        self.worker_id = settings.worker_name(self.role)
        self.redis = redis.Redis.from_url(settings.redis_url)
        # room for the prompts in flight (a paused request resumes with up to max_seq_len - 1
        # tokens); the rest of a shared GPU is the decode worker's
        cap = max(4 * settings.max_num_tokens, 2 * settings.max_seq_len)
        tp_size, shm_path = settings.tp_size("prefill"), None
        if tp_size > 1:  # every rank's pool in a file this process maps: a handoff sends every head
            if resolve_transport(settings.kv_transport, resolve_device(settings.device)) != "shm":
                raise ValueError("a prefill worker of --prefill-tp above 1 hands KV over with the shm transport "
                                 "(the CPU) only, for now")
            shm_path = new_pool_path(pool_dir(settings.shm_dir), self.worker_id)
        self.runner = build_runner(settings, shm_path=shm_path, gpu_cap_tokens=cap, tp_size=tp_size,
                                   shared_ranks=tp_size > 1)
        self.transport = get_transport(resolve_transport(settings.kv_transport, self.runner.device), settings)
        self.block_size = settings.tokens_per_block
        self.allocator = BlockAllocator(self.runner.kv_pool.num_blocks, self.block_size)
        if self.allocator.num_total * self.block_size < settings.max_seq_len:
            raise ValueError(
                f"prefill KV pool holds {self.allocator.num_total * self.block_size} tokens, "
                f"less than --max-seq-len {settings.max_seq_len} (a resumed request can be that long)"
            )
        warm_up_prefill(self.runner, self.allocator, settings.max_num_tokens)
        warm_up_penalties(self.runner)  # first tokens with a repetition penalty
        # a step whose first chunks hold one token each attends them as decode rows
        warm_up_mixed(self.runner, self.allocator, settings.max_batch_size, settings.max_seq_len,
                      settings.max_num_tokens)
        if settings.enable_prefix_caching and settings.kv_host_cache_gb > 0:
            self.host_tier = HostKVTier(self.runner.kv_pool, int(settings.kv_host_cache_gb * 1e9))
        self.prefix_cache = PrefixCache(self.allocator, enabled=settings.enable_prefix_caching,
                                        host_tier=self.host_tier)
        self.scheduler = PrefillScheduler(
            self.allocator,
            max_num_tokens=settings.max_num_tokens,
            max_batch_size=settings.max_batch_size,
            policy=settings.context_chunking_policy,
            prefix_cache=self.prefix_cache,
            attention_window=self.runner.config.attention_window(),
            max_loras=settings.max_loras if self.runner.lora is not None else None,
        )
        self.lora_loads = AdapterLoads(self.runner.lora, settings.lora_module_paths())  # reads --lora-modules
        self.prefix_index = None  # what the decode workers route by
        if settings.enable_prefix_caching:
            self.prefix_index = PrefixIndex(self.redis, self.worker_id, self.prefix_cache,
                                            settings.heartbeat_ttl_s, settings.heartbeat_interval_s, self.host_tier)
        self.eos_token_ids = self.runner.config.eos_token_ids
        self.guides = Guides(settings.tokenizer or settings.model, self.runner.config.vocab_size, self.eos_token_ids)
        self.inbox = Inbox(self.redis, keys.inbox(self.role, self.worker_id), self.worker_id)
        self.outbox = Outbox(self.redis)
        self.mailer = Mailer(self.redis)  # PrefillDone: a Redis error must not lose it (its job is forgotten)
        self.policies = LivePolicies(self.redis, settings)
        self.heartbeat = Heartbeat(
            settings.redis_url, self.info, settings.heartbeat_interval_s, settings.heartbeat_ttl_s
        )
        self._connections: dict[tuple, object] = {}  # (decode worker id, its endpoint) -> Connection
        self._pool_of: dict[str, tuple] = {}  # decode worker id -> the key of its pool's connection
        # a request sent back to this worker (re-dispatched) while its first job still drains: request id -> job
        self._deferred: dict[str, PrefillJob] = {}
        self._started_at = time.time()
        self._device_identity = device_identity(self.runner.device)
        device, tier = self.runner.device, self.host_tier
        self.stats = StepStats(self.role, settings.stats_interval_s,
                               counters=lambda: allocator_counters(device) | host_tier_counters(tier))

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> None:
        started = time.perf_counter()
        part = self.stats.phase  # where the turn's time goes (cluster.step_stats)
        with part("publish"):
            self.mailer.flush()  # PrefillDones a Redis outage kept back go out first
            self.outbox.flush()  # then the first tokens it kept back (their PrefillDones are ahead of them)
        busy = self.scheduler.jobs or self.lora_loads.num_waiting
        with part("inbox"):  # idle: mostly the wait for a message
            messages = self.inbox.read(block_ms=None if busy else 20)
        with part("intake"):
            self._handle_messages(messages)
            self._adapters_read()
        with part("schedule"):
            self.scheduler.set_policy(self.policies.refresh().context_chunking_policy)
            chunks = self.scheduler.schedule()
        if chunks:
            forward_started = time.perf_counter()
            with part("step"):  # the forward, its first tokens and the KV pushed to the decode workers
                logits = self._run(chunks)
                if logits is not None:
                    self._after_forward(chunks, logits)
            self.stats.record(sum(n for _, n in chunks), time.perf_counter() - forward_started,
                              time.perf_counter() - started)
        with part("upkeep"):  # transfers finished, re-dispatched requests, the routing index, host tier
            self._poll_transfers()
            self._accept_deferred()
            if self.prefix_index is not None:
                self.prefix_index.sync()
            host = {}
            if self.host_tier is not None:
                self.host_tier.poll()
                host = {"host_blocks": len(self.host_tier), "host_hits": self.host_tier.stats.loaded_blocks}
        self.stats.maybe_log(jobs=len(self.scheduler.jobs), transferring=len(self.scheduler.transferring),
                             free_blocks=self.allocator.num_free, **host)

    def serve(self, stop) -> None:
        log.info("prefill worker ready", worker_id=self.worker_id, num_blocks=self.allocator.num_total)
        compile_watch.serving()  # a kernel compiled from here on is a warning: the warm-up missed it
        serve_steps(self, stop)

    def info(self) -> WorkerInfo:
        return worker_info(
            self.settings, self.role, self.worker_id, self.inbox.stream, self._started_at,
            num_total_blocks=self.allocator.num_total,
            num_free_blocks=self.prefix_cache.num_available,  # cached blocks nobody holds count as free
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + self.lora_loads.num_waiting,
            device=self._device_identity,
            prefix_device_hits=self.scheduler.num_device_hit_blocks,
            **host_tier_info(self.host_tier),
        )

    # ---- helpers --------------------------------------------------------------------
    def _handle_messages(self, messages: list) -> None:
        for msg in messages:
            self._guarded(self._handle, msg)

    def _guarded(self, handle, msg) -> None:
        """``handle(msg)``; an error of the message's (anything but a Redis error) is logged and
        the message dropped, its job failed when it was not taken: the worker goes on."""
        try:
            handle(msg)
        except redis.RedisError:
            raise
        except Exception as exc:
            log.exception("message handling failed; dropped", kind=msg.kind)
            if (isinstance(msg, PrefillJob) and msg.request_id not in self.scheduler.jobs
                    and msg.request_id not in self._deferred and not self._held(msg.request_id)):
                self._reply(PrefillState(job=msg), "failed", error=f"the job could not be taken: {exc}")

    def _handle(self, msg) -> None:
        if isinstance(msg, PrefillJob):
            self._accept(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        elif isinstance(msg, Unreadable):
            self._reject(msg)
        else:
            log.error("unexpected message", kind=msg.kind)

    def _reject(self, entry: Unreadable) -> None:
        """An invalid PrefillJob that names its request and decode worker: answered with
        PrefillDone(failed), so the decode side frees its blocks now instead of at its transfer
        timeout. Not when a job of that request is here: its blocks are still being written."""
        body = entry.body
        request_id, decode_worker_id = named(body, "request_id"), named(body, "decode_worker_id")
        if (named(body, "kind") != "PrefillJob" or decode_worker_id is None
                or request_id in self.scheduler.jobs or request_id in self._deferred or self._held(request_id)):
            return
        done = PrefillDone(request_id, "failed", error=f"invalid PrefillJob: {entry.error}",
                           prefill_worker_id=self.worker_id, handoff_id=named(body, "handoff_id") or "")
        self.mailer.send(keys.inbox("decode", decode_worker_id), done)

    def _accept(self, job: PrefillJob) -> None:
        current = self.scheduler.jobs.get(job.request_id)
        if current is not None:
            if job.handoff_id and job.handoff_id != current.job.handoff_id:
                # the request came back here (its first job was taken away while this worker's beats
                # lapsed) and that job still drains its writes: this one is taken once it is gone
                self._deferred[job.request_id] = job
                return
            log.error("duplicate prefill job ignored", request_id=job.request_id)
            return
        state = PrefillState(job=job)
        problem = job_problem(job, self.settings.max_seq_len, self.block_size, self.allocator,
                              self.runner.config.vocab_size, self.lora_loads, self.runner.kv_pool)
        if problem is not None:
            log.error("prefill job refused", request_id=job.request_id, error=problem)
            self._reply(state, "failed", error=problem)
            return
        adapter = AdapterRef.of(job)
        if adapter is not None:
            state.lora_key = adapter.key
            # a later dispatch of the same request (re-dispatched here) supersedes one still waiting
            self.lora_loads.take(lambda s: s.request_id == job.request_id)
            if not self.lora_loads.ready(adapter):  # read in the background; other jobs' steps go on
                self.lora_loads.hold(adapter, state)
                return
        self._start(state)

    def _start(self, state: PrefillState) -> None:
        """Connect to the job's destination pool and queue it for its chunks."""
        job = state.job
        try:
            state.sender = KVSender(self._connect(job), job.dst_block_ids, job.handoff_id or None)
        except TransferError as exc:
            self._reply(state, "failed", error=str(exc))
            return
        self.scheduler.add(state)

    def _connect(self, job: PrefillJob):
        """The connection to the job's decode pool, made once per pool. A decode worker that
        comes back (restarted under its id) exports a new pool: the old connection is closed, so
        its mapping (RAM in /dev/shm, or GPU memory over CUDA IPC) and sockets are let go, and
        jobs still writing to the old pool fail."""
        endpoint = job.kv_endpoint
        # per decode worker too: an nccl endpoint (host, ports) can be another worker's later
        key = (job.decode_worker_id, endpoint.get("path") or repr(sorted(endpoint.items())))
        old = self._pool_of.get(job.decode_worker_id)
        if old is not None and old != key:
            connection = self._connections.pop(old, None)
            if connection is not None:
                connection.close()
        self._pool_of[job.decode_worker_id] = key
        if key not in self._connections:
            self._connections[key] = self.transport.connect(endpoint)
        return self._connections[key]

    def _held(self, request_id: str) -> bool:
        """Whether a job of this request waits here for its LoRA adapter to be read."""
        return any(s.request_id == request_id for s in self.lora_loads.waiting())

    def _adapters_read(self) -> None:
        """Jobs that waited for their LoRA adapter: started, or failed with the reason."""
        released, failed = self.lora_loads.poll()
        for state in released:
            try:
                self._start(state)
            except redis.RedisError:
                raise
            except Exception as exc:  # the job's, not the worker's
                log.exception("prefill job could not be started", request_id=state.request_id)
                self._reply(state, "failed", error=f"the job could not be taken: {exc}")
        for state, error in failed:
            log.error("prefill job refused", request_id=state.request_id, error=error)
            self._reply(state, "failed", error=error)

    def _accept_deferred(self) -> None:
        for request_id in [r for r in self._deferred if r not in self.scheduler.jobs]:
            self._guarded(self._accept, self._deferred.pop(request_id))

    def _abort(self, request_id: str) -> None:
        for state in self.lora_loads.take(lambda s: s.request_id == request_id):  # its adapter still read
            self._reply(state, "aborted")
        deferred = self._deferred.pop(request_id, None)
        if deferred is not None:  # the later job (the first one's abort came before it)
            self._reply(PrefillState(job=deferred), "aborted")
        state = self.scheduler.jobs.get(request_id)
        if state is None or state.status is RequestStatus.TRANSFERRING:
            return  # unknown (already reported) or draining: PrefillDone follows anyway
        self._give_up(state, "aborted", None)

    def _fail_job(self, state: PrefillState, error: str) -> None:
        if state.status is not RequestStatus.TRANSFERRING:
            self._give_up(state, "failed", error)

    def _give_up(self, state: PrefillState, status: str, error: str | None) -> None:
        """End a job early. Writes still in flight keep the destination blocks busy, so
        PrefillDone waits for them (ownership: no write lands after PrefillDone)."""
        if state.status is RequestStatus.PREFILLING and state.sender.poll() is KVPoll.TRANSFERRING:
            state.abandoned = (status, error)
            state.sender.finish()
            self.scheduler.drain(state)
            return
        self.scheduler.finish(state, RequestStatus.ABORTED if status == "aborted" else RequestStatus.FAILED)
        self._reply(state, status, error=error)

    def _run(self, chunks: list[tuple[PrefillState, int]]):
        try:
            return run_chunks(self.runner, chunks)
        except Exception as exc:  # an engine error fails these jobs, not the worker
            log.exception("prefill forward failed")
            for state, _ in chunks:
                self._fail_job(state, f"prefill failed: {exc}")
            return None

    def _after_forward(self, chunks: list[tuple[PrefillState, int]], logits) -> None:
        completed, rows_of_completed, scored = chunks_done(chunks, self.scheduler, self.runner, self.block_size)
        if scored:
            self.outbox.send(scored)
        if not completed:
            return
        queued = first_token_events(completed, logits[rows_of_completed], self.eos_token_ids, self.guides,
                                    self.settings.max_seq_len)
        self.outbox.keep(queued)  # no Redis call: a Redis error below loses no first token
        # handoffs whose writes are all in place (every one, with a synchronous transport) end
        # before their first token goes out: once a client has a first token, its decode worker
        # has the PrefillDone too, and never computes the prompt again should this worker die now
        self._poll_transfers()
        self.outbox.flush()

    def _poll_transfers(self) -> None:
        for state in list(self.scheduler.transferring):
            status = state.sender.poll()
            if state.abandoned is not None and status in (KVPoll.SUCCESS, KVPoll.FAILED):
                reply, error = state.abandoned
                self.scheduler.finish(state, RequestStatus.ABORTED if reply == "aborted" else RequestStatus.FAILED)
                self._reply(state, reply, error=error)
            elif status is KVPoll.SUCCESS:
                self.scheduler.finish(state, RequestStatus.FINISHED)
                self._reply(state, "ok")
            elif status is KVPoll.FAILED:
                self.scheduler.finish(state, RequestStatus.FAILED)
                self._reply(state, "failed", error=state.sender.error)
        for state in list(self.scheduler.prefilling):
            status = state.sender.poll()
            if status is KVPoll.FAILED:
                self.scheduler.finish(state, RequestStatus.FAILED)
                self._reply(state, "failed", error=state.sender.error)
            elif status is KVPoll.WAITING_FOR_INPUT:  # no write still reads the blocks
                self.scheduler.release_out_of_window(state)

    def _reply(self, state: PrefillState, status: str, error: str | None = None) -> None:
        job = state.job
        done = PrefillDone(job.request_id, status, state.first_token if status == "ok" else None,
                           state.finish_reason, error, prefill_worker_id=self.worker_id, handoff_id=job.handoff_id)
        self.mailer.send(keys.inbox("decode", job.decode_worker_id), done)


def main(settings: Settings, stop) -> None:
    PrefillWorker(settings).serve(stop)
