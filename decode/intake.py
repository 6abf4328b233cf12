"""A decode worker's intake: how many requests the gateways may admit onto it, which of those it
takes, aborts that come before their request, and the admissions it gives back.

- How many: ``ADMITTED_BATCHES`` batches (its record's ``max_admitted``, ``cluster.admission``).
- Which: a worker trusts no message. The gateway admits a request within the same limits, but
  a GenerateRequest asking for more than the worker's context or pool could hold, with token
  ids outside its vocabulary, or naming an adapter it cannot serve would take blocks it cannot
  use or fail its step: it is refused (``request_problem``), its client gets the error and its
  admission is given back. A request whose LoRA adapter is still being read waits for it, then
  goes to the scheduler or is refused (``adapters_read``). A PrefillDone whose first token is outside the vocabulary fails its
  handoff (``checked_prefill_done``). An inbox entry that does not decode but names its request
  is answered (``reject``) instead of leaving its client, or its handoff, waiting.
- Aborts first: the admin API may cancel a request between the gateway's admission and its
  submission. Its abort is remembered for a while (``remember_early_abort``), and the request
  ends as it arrives.
- Given back (``Admissions``): the admission of every request that ends here, by any path; now
  and then, those of requests the worker never received.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog

from tandem.cluster.admission import Reservations
from tandem.cluster.inbox import Unreadable
from tandem.cluster.messages import GenerateRequest, PrefillDone, named
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.block_allocator import BlockAllocator, blocks_for
from tandem.engine.lora_loads import AdapterLoads, AdapterRef

log = structlog.get_logger(__name__)

EARLY_ABORT_TTL_S = 60.0  # how long an abort for a request not (yet) here is remembered
RECONCILE_INTERVAL_S = 5.0  # how often admission entries of requests never seen are looked for
# Requests a worker holds admitted, in batches: the running one and the next, waiting here. When a
# wave of requests finishes together (an offline batch of equal lengths), the next wave is already
# in this worker's queue, its prompts computed as rows free up, instead of trickling in from the
# gateway one admission at a time while the GPU idles. The KV charge of each capacity policy
# bounds what the waiting ones may hold, as before.
ADMITTED_BATCHES = 2

Refuse = Callable[[str, str, str], None]  # (request_id, reply_to, error): the worker ends a request it does not take


def request_problem(msg: GenerateRequest, max_seq_len: int, allocator: BlockAllocator, vocab_size: int | None,
                    lora_loads: AdapterLoads) -> str | None:
    """Why a worker of these limits cannot run a request that decoded (None: it can). The
    gateway checks the same limits, but a worker trusts no message: one asking for more than
    its context or its pool could hold would take blocks it cannot use."""
    num_prompt = len(msg.prompt_token_ids)
    if num_prompt >= max_seq_len:
        return f"the prompt has {num_prompt} tokens, no fewer than this worker's max_seq_len {max_seq_len}"
    if num_prompt + msg.max_tokens > max_seq_len:
        return (f"the prompt's {num_prompt} tokens + max_tokens {msg.max_tokens} exceed this worker's "
                f"max_seq_len {max_seq_len}")
    needed = blocks_for(num_prompt + msg.max_tokens, allocator.block_size)
    if needed > allocator.num_total:
        return f"the request needs {needed} KV blocks, more than this worker's pool of {allocator.num_total}"
    if not in_vocab(msg.prompt_token_ids, vocab_size) or not in_vocab(msg.output_token_ids, vocab_size):
        return f"token ids outside the vocabulary of {vocab_size}"
    adapter = AdapterRef.of(msg)
    return None if adapter is None else lora_loads.problem(adapter)


def in_vocab(token_ids: list[int], vocab_size: int | None) -> bool:
    return vocab_size is None or all(t < vocab_size for t in token_ids)


def adapters_read(lora_loads: AdapterLoads, scheduler: DecodeScheduler, refuse: Refuse) -> None:
    """Requests that waited for their LoRA adapter to be read: to the scheduler, or refused."""
    released, failed = lora_loads.poll()
    for request in released:
        scheduler.add(request)
    for request, error in failed:
        refuse(request.request_id, request.spec.reply_to, error)


def checked_prefill_done(msg: PrefillDone, vocab_size: int | None) -> PrefillDone:
    """``msg``, failed when its first token is outside the vocabulary (the decode step would
    embed it: an index out of range)."""
    if msg.status == "ok" and msg.first_token is not None and not in_vocab([msg.first_token], vocab_size):
        return dataclasses.replace(msg, status="failed", first_token=None,
                                   error=f"first token {msg.first_token} is outside the vocabulary")
    return msg


def reject(entry: Unreadable, scheduler: DecodeScheduler, refuse: Refuse) -> None:
    """An invalid message that names a request: a GenerateRequest's client gets the error (not
    a hang); a PrefillDone for a handoff in flight fails that handoff (``handoffs.check`` then
    ends it as any failed transfer, holding blocks the prefill worker may still write)."""
    kind, request_id = named(entry.body, "kind"), named(entry.body, "request_id")
    if kind == "GenerateRequest":
        reply_to = named(entry.body, "reply_to")
        if reply_to is not None and request_id not in scheduler.requests:
            refuse(request_id, reply_to, f"invalid request: {entry.error}")
    elif kind == "PrefillDone":
        request, handoff_id = scheduler.prefilling.get(request_id), named(entry.body, "handoff_id")
        if (request is not None and request.receiver is not None and handoff_id is not None
                and handoff_id == request.dispatch_id):  # the reply to the job in flight, not a stale one
            request.receiver.fail(f"invalid PrefillDone: {entry.error}")


def remember_early_abort(early_aborts: dict[str, float], request_id: str, now: float) -> None:
    """Remember at ``now`` an abort for a request not here (yet) in ``early_aborts`` (request id
    -> when), forgetting those older than EARLY_ABORT_TTL_S."""
    while early_aborts:  # oldest first (insertion order)
        oldest, at = next(iter(early_aborts.items()))
        if now - at < EARLY_ABORT_TTL_S:
            break
        del early_aborts[oldest]
    early_aborts.pop(request_id, None)
    early_aborts[request_id] = now


class Admissions:
    """The admissions a decode worker holds (``cluster.admission.Reservations``): none when it
    starts, given back as its requests end, and every RECONCILE_INTERVAL_S those of requests it
    never received too (their GenerateRequest lost on the way)."""

    def __init__(self, reservations: Reservations):
        self.reservations = reservations
        self.reservations.clear()  # a new incarnation holds no admitted request
        self._reconciled_at = time.monotonic()

    def release(self, request_ids: list[str]) -> None:
        """Give back the admissions of requests that left (a Redis error raises: retry them)."""
        self.reservations.release(request_ids)

    def reconcile(self, known_ids: Callable[[], set[str]]) -> None:
        """Now and then: give back the admissions of requests not in ``known_ids()`` (here, or
        waiting for their adapter) at this pass and the one before: they never reached it."""
        if time.monotonic() - self._reconciled_at < RECONCILE_INTERVAL_S:
            return
        self._reconciled_at = time.monotonic()
        leaked = self.reservations.reconcile(known_ids())
        if leaked:
            log.warning("released admissions of requests never received", request_ids=leaked)
