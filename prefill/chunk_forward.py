"""One prefill forward over the prompt chunks a step runs, and what comes of it.

The chunks the scheduler picked run as one forward, each in its LoRA adapter's slot. A job
asking for its prompt's logprobs (``SamplingParams.prompt_logprobs``) is run through
``ModelRunner.forward_hidden`` and scored chunk by chunk (``tandem.engine.prompt_logprobs``);
they go out with its first TokenEvent.

After the forward each chunk's blocks are pushed into its decode worker's destination blocks
(a job's first chunk also sends the blocks it took from the prefix cache) and its job moves on.
A job whose prompt is then complete ends its sender (no more blocks) and:

- a resumed job (a paused request's KV, recomputed) is done: its request has its tokens already;
- a max_tokens 0 job samples nothing: its one event carries no token, finishes by length, and
  its handoff ends without a first token (nor any KV sent);
- any other samples its first token from its last row's logits, for its first TokenEvent.

The worker publishes the events and reports the handoffs (``tandem.prefill.worker``).
"""

from __future__ import annotations

from tandem.cluster.messages import TokenEvent
from tandem.cluster.request_state import finish_reason
from tandem.engine.attention import SeqChunk
from tandem.engine.guide import Guides
from tandem.engine.lora_slots import lora_slots
from tandem.engine.prompt_logprobs import chunk_entries, num_scored, rows_per_slice
from tandem.engine.sampling_pipeline import FirstToken, host_entries, sample_first_tokens
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler

Chunks = list[tuple[PrefillState, int]]  # (a job, how many of its prompt tokens the step computes)


def run_chunks(runner, chunks: Chunks):
    """One forward over ``chunks`` -> logits, one row per chunk (its last token's); the chunks of
    jobs that score their prompt add their prompt logprobs to the job."""
    slots = lora_slots(runner, [state.lora_key for state, _ in chunks])
    seqs = []
    for state, num_tokens in chunks:
        start = state.num_computed
        seqs.append(SeqChunk(state.job.prompt_token_ids[start : start + num_tokens], start, state.block_ids,
                             slots.get(state.lora_key, -1)))
    if not any(state.scores_prompt for state, _ in chunks):
        return runner.forward(seqs)
    logits, hidden = runner.forward_hidden(seqs)
    score_prompts(runner, chunks, hidden)
    return logits


def score_prompts(runner, chunks: Chunks, hidden) -> None:
    """The logprobs of the prompt tokens each scoring job's chunk predicts (``hidden``: every
    new token's final state, the chunks' tokens in order), kept on the job until its first
    TokenEvent. Before ``on_chunk_done``: ``num_computed`` is still the chunk's start."""
    offset, slice_rows = 0, rows_per_slice(runner.config.vocab_size)
    for state, num_tokens in chunks:
        if state.scores_prompt:
            start, prompt = state.num_computed, state.job.prompt_token_ids
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None]  # the first prompt token: nothing precedes it
            n = num_scored(start, num_tokens, len(prompt))
            state.prompt_logprobs += chunk_entries(runner.compute_logits, hidden[offset : offset + n],
                                                   prompt[start + 1 : start + 1 + n],
                                                   state.job.sampling.prompt_logprobs, slice_rows)
        offset += num_tokens


def chunks_done(chunks: Chunks, scheduler: PrefillScheduler, runner,
                block_size: int) -> tuple[list[PrefillState], list[int], list[tuple[str, TokenEvent]]]:
    """After the forward: each chunk's blocks sent to its decode worker and its job moved on ->
    (the jobs whose prompt completed and that sample a first token, their rows of the logits,
    the events of the max_tokens 0 jobs that completed)."""
    completed, rows_of_completed, scored = [], [], []
    for row, (state, num_tokens) in enumerate(chunks):
        start = state.num_computed
        # a job's first chunk also sends the blocks it took from the prefix cache
        first_block = 0 if start == state.num_cached_tokens else start // block_size
        last_block = (start + num_tokens - 1) // block_size
        if state.job.max_tokens:  # max_tokens 0: no decoding follows, its KV is not needed there
            state.sender.send_blocks(runner.handoff_kv(), state.block_ids[first_block : last_block + 1], first_block)
        if scheduler.on_chunk_done(state, num_tokens):
            if state.job.resume:  # a paused request's KV, recomputed: it has its tokens already
                state.sender.finish()
                continue
            if not state.job.max_tokens:  # the prompt only scored: nothing is sampled
                scored.append(scored_event(state))
                continue
            completed.append(state)
            rows_of_completed.append(row)
    return completed, rows_of_completed, scored


def first_token_events(completed: list[PrefillState], logits, eos_token_ids: list[int], guides: Guides,
                       max_seq_len: int) -> list[tuple[str, TokenEvent]]:
    """The first token of each completed job, sampled from its row of ``logits`` (in order) ->
    each job's first TokenEvent, for its reply_to; the job keeps its token and finish reason
    (for its PrefillDone) and its sender ends."""
    params = [s.job.sampling for s in completed]
    rows = [FirstToken(s.job.sampling, s.job.prompt_token_ids, s.job.stop_token_ids, s.job.ignore_eos)
            for s in completed]
    sampled = sample_first_tokens(logits, rows, eos_token_ids, guides)
    token_ids = sampled.tokens.tolist()
    entries = host_entries(sampled, params)
    queued = []
    for state, token_id, entry in zip(completed, token_ids, entries):
        job = state.job
        state.first_token = token_id
        state.finish_reason = finish_reason(
            token_id, 1, state.num_prompt_tokens + 1,
            max_tokens=job.max_tokens, max_seq_len=max_seq_len,
            stop_token_ids=job.stop_token_ids, eos_token_ids=eos_token_ids, ignore_eos=job.ignore_eos,
            min_tokens=job.sampling.min_tokens,
        )
        queued.append((job.reply_to, TokenEvent(job.request_id, 0, [token_id], state.finish_reason,
                                                num_cached_tokens=state.num_cached_tokens,
                                                logprobs=None if entry is None else [entry],
                                                prompt_logprobs=state.prompt_logprobs)))
        state.sender.finish()
    return queued


def scored_event(state: PrefillState) -> tuple[str, TokenEvent]:
    """A max_tokens 0 job's one event: no token, finished by length, the prompt's logprobs.
    Its handoff ends (PrefillDone "ok" without a first token) and the decode worker ends it."""
    job = state.job
    state.finish_reason = "length"
    state.sender.finish()
    return job.reply_to, TokenEvent(job.request_id, 0, [], "length", num_cached_tokens=state.num_cached_tokens,
                                    prompt_logprobs=state.prompt_logprobs)
