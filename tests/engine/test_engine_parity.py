"""Engine logits vs transformers (eager, fp32) on tiny random checkpoints.

Three sequences are run the way the workers will run them: prompts in chunks
of 7 over non-contiguous blocks, started at different steps so one forward
mixes prompt chunks with decode tokens, then 20 greedy decode steps each.
Every logits row the engine produces is compared with HF's logits at the same
position of a single full-sequence forward (causal, so position p only sees
tokens <= p).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engine.attention import SeqChunk
from tandem.engine.config import ModelConfig
from tandem.engine.rope import build_cos_sin_cache
from tandem.engine.runner import ModelRunner

CHUNK_SIZE = 7
NUM_DECODE_STEPS = 20
PROMPT_LENS = (19, 45, 30)  # two exceed mistral's window of 24
START_STEPS = (0, 3, 9)  # seq 1 prefills while seq 0 decodes, seq 2 while both decode
TOLERANCE = 1e-4


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    block_ids: list[int]
    start_step: int
    num_computed: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [vocab]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.num_generated == NUM_DECODE_STEPS + 1


def _make_seqs(vocab_size: int, num_blocks: int, block_size: int) -> list[_Seq]:
    rng = random.Random(1234)
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order block tables
    seqs = []
    for prompt_len, start in zip(PROMPT_LENS, START_STEPS):
        needed = -(-(prompt_len + NUM_DECODE_STEPS + 1) // block_size)
        block_ids, free = free[:needed], free[needed:]
        prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        seqs.append(_Seq(prompt, prompt_len, block_ids, start))
    return seqs


def _run_engine(runner: ModelRunner, seqs: list[_Seq]) -> set[str]:
    """Steps until every sequence is done; returns the kinds of batches seen."""
    kinds = set()
    step = 0
    while not all(s.finished for s in seqs):
        active = [s for s in seqs if s.start_step <= step and not s.finished]
        chunks = [SeqChunk(s.tokens[s.num_computed : s.num_computed + CHUNK_SIZE], s.num_computed, s.block_ids)
                  for s in active]
        q_lens = {len(c.token_ids) for c in chunks}
        kinds.add("decode" if q_lens == {1} else "mixed" if 1 in q_lens else "prefill")
        logits = runner.forward(chunks)
        for seq, chunk, row in zip(active, chunks, logits):
            seq.num_computed += len(chunk.token_ids)
            seq.logits[seq.num_computed - 1] = row.clone()
            if seq.num_computed == len(seq.tokens):  # caught up: the row predicts a new token
                seq.tokens.append(int(row.argmax()))
        step += 1
    return kinds


def _max_diff_vs_hf(hf_model, seqs: list[_Seq]) -> float:
    worst = 0.0
    with torch.no_grad():
        for seq in seqs:
            ref = hf_model(torch.tensor([seq.tokens])).logits[0]  # [S, vocab]
            for pos, row in seq.logits.items():
                worst = max(worst, (row - ref[pos]).abs().max().item())
    return worst


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_chunked_mixed_batch_matches_hf(tiny_checkpoints, arch, block_size):
    path = tiny_checkpoints[arch]
    runner = ModelRunner(path, num_blocks=64, block_size=block_size)
    seqs = _make_seqs(runner.config.vocab_size, runner.num_blocks, block_size)
    kinds = _run_engine(runner, seqs)
    assert kinds == {"prefill", "mixed", "decode"}
    assert all(len(s.logits) > NUM_DECODE_STEPS for s in seqs)
    assert _max_diff_vs_hf(_hf(path), seqs) <= TOLERANCE


def test_qwen2_per_layer_sliding_window_matches_hf(tiny_qwen2_windowed):
    runner = ModelRunner(tiny_qwen2_windowed, num_blocks=64, block_size=4)
    assert [layer.sliding_window for layer in runner.model.layers] == [None, 16]
    seqs = _make_seqs(runner.config.vocab_size, runner.num_blocks, 4)
    _run_engine(runner, seqs)
    assert _max_diff_vs_hf(_hf(tiny_qwen2_windowed), seqs) <= TOLERANCE


def test_parity_check_catches_rope_and_window_bugs(tiny_checkpoints):
    """The tiny models are sensitive enough that a wrong RoPE or a dropped window fails by far."""
    llama = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=4)
    plain = ModelConfig.from_pretrained(tiny_checkpoints["llama"])
    plain.rope_scaling = None  # forget llama3 scaling
    llama.model.set_cos_sin_cache(build_cos_sin_cache(plain, 512, "cpu"))
    seqs = _make_seqs(llama.config.vocab_size, 64, 4)
    _run_engine(llama, seqs)
    assert _max_diff_vs_hf(_hf(tiny_checkpoints["llama"]), seqs) > 100 * TOLERANCE

    mistral = ModelRunner(tiny_checkpoints["mistral"], num_blocks=64, block_size=4)
    for layer in mistral.model.layers:
        layer.sliding_window = None
    seqs = _make_seqs(mistral.config.vocab_size, 64, 4)
    _run_engine(mistral, seqs)
    assert _max_diff_vs_hf(_hf(tiny_checkpoints["mistral"]), seqs) > 100 * TOLERANCE


def test_prefill_hands_the_chunks_keys_to_the_attention(tiny_checkpoints, monkeypatch):
    """Each layer's prefill attention gets the chunk's rotated k and its v (chunk_kv, which the
    Triton kernel reads instead of the cache), equal to what the layer wrote to its cache at the
    chunk's positions; a second chunk of the same sequence gets only its own tokens."""
    from tandem.kernels import reference

    calls = []
    real = reference.prefill_attention
    monkeypatch.setattr(reference, "prefill_attention", lambda *args: calls.append(args) or real(*args))
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=4)
    blocks = [5, 2, 9, 7]
    for start, tokens in ((0, list(range(3, 13))), (10, [20, 21, 22, 23, 24])):
        calls.clear()
        runner.forward([SeqChunk(tokens, start, blocks)])
        assert len(calls) == runner.config.num_layers
        for q, k_cache, v_cache, *_, chunk_kv in calls:
            k, v = chunk_kv
            assert k.shape == v.shape == (len(tokens), k_cache.shape[2], k_cache.shape[3])
            cached_k = k_cache[blocks].flatten(0, 1)[start:start + len(tokens)]
            cached_v = v_cache[blocks].flatten(0, 1)[start:start + len(tokens)]
            assert torch.equal(k, cached_k) and torch.equal(v, cached_v)
