"""The checks a prefill job passes before the prefill worker takes it (``job_problem``), as a
decode worker's requests pass ``decode.intake.request_problem``: a worker trusts no message."""

from __future__ import annotations

from tandem.cluster.messages import PrefillJob
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.lora_loads import AdapterLoads, AdapterRef
from tandem.kvtransfer.sender import kv_format_mismatch, pool_num_blocks


def job_problem(job: PrefillJob, max_seq_len: int, block_size: int, allocator: BlockAllocator, vocab_size: int,
                lora_loads: AdapterLoads, kv_pool) -> str | None:
    """Why a prefill worker of these limits, pool (``kv_pool``) and adapters cannot run a job that
    decoded (None: it can): what needs its model, limits and the destination pool; a prompt it
    could never be given room for would hold up every job behind it."""
    num_prompt = len(job.prompt_token_ids)
    if num_prompt >= max_seq_len:
        return f"the prompt has {num_prompt} tokens, no fewer than max_seq_len {max_seq_len}"
    if not job.resume and num_prompt + job.max_tokens > max_seq_len:  # a resume's prompt holds its output
        return f"the prompt's {num_prompt} tokens + max_tokens {job.max_tokens} exceed max_seq_len {max_seq_len}"
    if job.max_tokens and len(job.dst_block_ids) * block_size < num_prompt:
        # its last chunks would have nowhere to go: refused before any forward is spent on it
        return (f"{len(job.dst_block_ids)} destination blocks cannot hold the prompt's {num_prompt} tokens "
                f"({block_size} a block)")
    if not allocator.can_allocate_total(num_prompt):
        return f"{num_prompt} tokens exceed this prefill worker's KV pool of {allocator.num_total * block_size}"
    adapter = AdapterRef.of(job)
    if adapter is not None and (problem := lora_loads.problem(adapter)) is not None:
        return problem
    if max(job.prompt_token_ids) >= vocab_size:
        return f"prompt token ids outside the vocabulary of {vocab_size}"  # an embedding out of range
    num_dst = pool_num_blocks(job.kv_endpoint)
    if num_dst is not None and max(job.dst_block_ids) >= num_dst:
        # a write there would land outside the decode worker's pool
        return f"destination blocks outside the decode worker's pool of {num_dst}"
    return kv_format_mismatch(job.kv_endpoint, kv_pool)  # blocks travel as bytes
