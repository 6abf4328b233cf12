"""Sliding windows in the engine: --max-attention-window-size reaches every layer, and the blocks the
schedulers release are never needed again (they are filled with garbage here and logits still match HF).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tandem.cluster.messages import GenerateRequest, PrefillJob
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.window import held_block_ids
from tandem.engine.attention import SeqChunk
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.config import ModelConfig
from tandem.engine.loader import load_model
from tandem.engine.runner import ModelRunner
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 40
GARBAGE = 1e4  # a released block that were read unmasked would swamp the logits
TOLERANCE = 1e-4


def _runner(path: str, max_attention_window: int | None = None) -> ModelRunner:
    model, config = load_model(path, max_attention_window=max_attention_window)
    return ModelRunner.from_model(model, config, NUM_BLOCKS, BLOCK_SIZE)


def _hf(path: str, **config_overrides):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                **config_overrides).eval()


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]  # [S, vocab]


def _poison_unheld(runner: ModelRunner, held: set[int]) -> None:
    unheld = [b for b in range(runner.num_blocks) if b not in held]
    runner.kv_pool.kv[:, :, unheld] = GARBAGE


def test_max_attention_window_reaches_every_layer_and_own_smaller_window_wins(tiny_checkpoints,
                                                                              tiny_qwen2_windowed):
    def windows(path, cap):
        model, config = load_model(path, max_attention_window=cap)
        return [layer.sliding_window for layer in model.layers], config.attention_window()

    assert windows(tiny_checkpoints["llama"], None) == ([None, None], None)
    assert windows(tiny_checkpoints["llama"], 40) == ([40, 40], 40)
    assert windows(tiny_checkpoints["mistral"], None) == ([24, 24], 24)
    assert windows(tiny_checkpoints["mistral"], 40) == ([24, 24], 24)  # the model's own window is smaller
    assert windows(tiny_checkpoints["mistral"], 16) == ([16, 16], 16)
    assert windows(tiny_qwen2_windowed, None) == ([None, 16], None)  # a full-attention layer keeps all KV
    assert windows(tiny_qwen2_windowed, 20) == ([20, 16], 20)
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "intermediate_size": 8}
    assert ModelConfig.from_dict(raw).attention_window() is None


def test_decode_scheduler_window_release_matches_hf(tiny_checkpoints):
    """A 16-token cap on Mistral (own window 24): same logits as HF Mistral with sliding_window=16."""
    path, window = tiny_checkpoints["mistral"], 16
    runner = _runner(path, max_attention_window=window)
    hf = _hf(path, sliding_window=window)
    alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    sched = DecodeScheduler(alloc, max_batch_size=4, max_seq_len=512, eos_token_ids=[],
                            attention_window=runner.config.attention_window())
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i, (prompt_len, max_tokens) in enumerate([(30, 40), (9, 50)]):
        prompt = torch.randint(3, runner.config.vocab_size, (prompt_len,), generator=gen).tolist()
        reqs.append(DecodeRequest(GenerateRequest(f"r{i}", prompt, SamplingParams(0.0), max_tokens,
                                                  arrival_time=float(i), ignore_eos=True)))
        sched.add(reqs[-1])
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {r.request_id: [] for r in reqs}
    for r in sched.schedule_prefills():  # the prompt in one forward, as a prefill worker would
        logits = runner.forward([SeqChunk(r.spec.prompt_token_ids, 0, r.block_ids)])[0]
        rows[r.request_id].append((r.num_prompt_tokens - 1, logits))
        sched.on_prefill_done(r, int(logits.argmax()), None)
    while sched.running:
        held = {b for r in sched.running for b in held_block_ids(r)}
        _poison_unheld(runner, held)  # released blocks may be reused by anyone: garbage them
        batch = sched.schedule_decode()
        logits = runner.forward([SeqChunk([r.output_token_ids[-1]], r.num_tokens - 1, r.block_ids) for r in batch])
        for r, row in zip(batch, logits):
            rows[r.request_id].append((r.num_tokens - 1, row))
        sched.on_step(batch, [int(row.argmax()) for row in logits])
        assert all(len(held_block_ids(r)) <= sched.window.max_live_blocks for r in sched.running)
    assert alloc.num_free == alloc.num_total
    for r in reqs:
        ref = _hf_logits(hf, r.spec.prompt_token_ids + r.output_token_ids)
        assert len(rows[r.request_id]) == r.spec.max_tokens
        worst = max((row - ref[pos]).abs().max().item() for pos, row in rows[r.request_id])
        assert worst <= TOLERANCE, (r.request_id, worst)


def test_prefill_scheduler_window_release_matches_hf(tiny_checkpoints):
    """Mistral's own window (24): a 70-token prompt in chunks of 7, blocks released between chunks."""
    path = tiny_checkpoints["mistral"]
    runner = _runner(path)
    alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    sched = PrefillScheduler(alloc, max_num_tokens=7, max_batch_size=2,
                             attention_window=runner.config.attention_window())
    prompt = torch.randint(3, runner.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    state = PrefillState(job=PrefillJob("p", prompt, SamplingParams(0.0), 1, [], {}, "d0"))
    sched.add(state)
    rows = []
    while state.status is not RequestStatus.TRANSFERRING:
        [(s, n)] = sched.schedule()
        logits = runner.forward([SeqChunk(prompt[s.num_computed : s.num_computed + n], s.num_computed,
                                          s.block_ids)])
        rows.append((s.num_computed + n - 1, logits[0]))
        sched.on_chunk_done(s, n)
        sched.release_out_of_window(s)
        _poison_unheld(runner, set(s.block_ids[s.num_released_blocks :]))
    assert state.num_released_blocks >= 10
    ref = _hf_logits(_hf(path), prompt)
    assert max((row - ref[pos]).abs().max().item() for pos, row in rows) <= TOLERANCE
    sched.finish(state, RequestStatus.FINISHED)
    assert alloc.num_free == alloc.num_total
