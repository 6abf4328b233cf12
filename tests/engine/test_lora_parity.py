"""Multi-LoRA through ModelRunner equals HF transformers + PEFT, token for token (fp32, CPU).

Three PEFT adapters of ranks 4, 8 and 16 (the 8 with rsLoRA on every linear module, the 16 on
q, v and down only, with its own rank for down and alpha for v through rank_pattern /
alpha_pattern) and the base model serve six sequences at once: prompts in chunks over shuffled
blocks, started at different steps so that steps mix decode rows and prompt chunks of different
adapters, then greedy decode steps. Every sequence's tokens equal PEFT's greedy tokens for its
adapter, and every logits row the engine produced equals PEFT's at that position; with the
LoRA ops' torch references (the CPU path) and with their Triton kernels (interpreted).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from lora_testing import make_peft_adapter

from tandem.engine.attention import SeqChunk
from tandem.engine.runner import ModelRunner

BLOCK = 4
CHUNK = 5
NEW_TOKENS = 12
TOLERANCE = 1e-4
# name -> (r, lora_alpha, target_modules, more LoraConfig options)
ADAPTERS = {
    "r4": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {}),
    "r8": (8, 16, "all-linear", {"use_rslora": True}),
    "r16": (16, 16, ["q_proj", "v_proj", "down_proj"], {"rank_pattern": {"down_proj": 8},
                                                         "alpha_pattern": {"v_proj": 32}}),
}
# (prompt length, adapter or None, first step)
SEQUENCES = [(11, "r4", 0), (17, None, 0), (9, "r8", 1), (23, "r16", 1), (13, "r4", 3), (8, None, 4)]


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    adapter: str | None
    start: int
    block_ids: list[int]
    num_computed: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [vocab]

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len == NEW_TOKENS


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tiny_checkpoints, tmp_path_factory):
    base = tiny_checkpoints[request.param]
    root = tmp_path_factory.mktemp(f"adapters_{request.param}")
    paths = {name: make_peft_adapter(base, root / name, r, alpha, targets, seed=i, **options)
             for i, (name, (r, alpha, targets, options)) in enumerate(ADAPTERS.items())}
    return base, paths


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n, _, _ in SEQUENCES]


def _peft_greedy(base: str, paths: dict[str, str], prompts: list[list[int]]):
    """-> per sequence (PEFT's greedy tokens, PEFT's logits [len, vocab] over them, the base model's tokens)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    names = list(paths)
    model = PeftModel.from_pretrained(model, paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(paths[name], adapter_name=name)
    model.eval()

    def greedy(prompt):
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids, model(torch.tensor([ids])).logits[0]

    results = []
    with torch.no_grad():
        for prompt, (_, adapter, _) in zip(prompts, SEQUENCES):
            with model.disable_adapter():
                base_ids, base_logits = greedy(prompt)
            if adapter is None:
                results.append((base_ids, base_logits, base_ids))
                continue
            model.set_adapter(adapter)
            results.append((*greedy(prompt), base_ids))
    return results


def _runner(base: str, paths: dict[str, str], device: str = "cpu", fuse: bool | None = None) -> ModelRunner:
    runner = ModelRunner(base, num_blocks=96, block_size=BLOCK, device=device)
    lora = runner.enable_lora(max_loras=3, max_rank=16, fuse=fuse)
    for name, path in paths.items():
        lora.add(name, path)
    return runner


def _sequences(prompts: list[list[int]]) -> list[_Seq]:
    free = list(range(96))
    random.Random(3).shuffle(free)  # non-contiguous block tables
    seqs = []
    for prompt, (n, adapter, start) in zip(prompts, SEQUENCES):
        needed = -(-(n + NEW_TOKENS) // BLOCK)
        seqs.append(_Seq(list(prompt), n, adapter, start, free[:needed]))
        free = free[needed:]
    return seqs


def _run_engine(runner: ModelRunner, seqs: list[_Seq]) -> set[str]:
    """Every step: the caught-up sequences' decode rows first, then prompt chunks; -> kinds of steps."""
    kinds, step = set(), 0
    while not all(s.done for s in seqs):
        active = [s for s in seqs if s.start <= step and not s.done]
        active.sort(key=lambda s: s.num_computed < len(s.tokens) - 1)  # decode rows lead
        slots = runner.lora.slots_for({s.adapter for s in active if s.adapter is not None})
        chunks = [SeqChunk(s.tokens[s.num_computed:s.num_computed + CHUNK], s.num_computed, s.block_ids,
                           lora_slot=slots.get(s.adapter, -1)) for s in active]
        kinds.add(frozenset("decode" if len(c.token_ids) == 1 else "prompt" for c in chunks))
        logits = runner.forward(chunks)
        for seq, chunk, row in zip(active, chunks, logits):
            seq.num_computed += len(chunk.token_ids)
            seq.logits[seq.num_computed - 1] = row.clone()
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(int(row.argmax()))
        step += 1
    return kinds


@pytest.mark.parametrize("kernels, fuse", [("reference", False), ("triton", False), ("reference", True),
                                           ("triton", True)])
def test_mixed_adapters_equal_peft_token_for_token(setup, kernels, fuse, monkeypatch):
    """``kernels`` "triton": the LoRA ops run as the Triton kernels (in the interpreter on the CPU).
    ``fuse``: the A stacks under the model's weights (LoraWeights.fuse_into: the shrinks are the
    projections' extra columns) or apart."""
    if kernels == "triton":
        from tandem.kernels import lora as lora_kernels
        from tandem.kernels import ops

        for name in ("lora_add", "lora_partials", "lora_expand_slots"):
            monkeypatch.setattr(ops, name, getattr(lora_kernels, name))
    base, paths = setup
    runner = _runner(base, paths, fuse=fuse)
    stack = runner.lora.weights.layers[0]["qkv_proj"]
    assert (stack.weight is not None) == fuse
    prompts = _prompts(runner.config.vocab_size)
    seqs = _sequences(prompts)
    kinds = _run_engine(runner, seqs)
    assert frozenset({"decode", "prompt"}) in kinds  # mixed steps ran

    expected = _peft_greedy(base, paths, prompts)
    for seq, (want_tokens, want_logits, base_tokens) in zip(seqs, expected):
        assert seq.tokens == want_tokens, f"adapter {seq.adapter}"
        if seq.adapter is not None:
            assert seq.tokens != base_tokens, f"adapter {seq.adapter} changes nothing: a weak test"
        for pos, row in seq.logits.items():
            torch.testing.assert_close(row, want_logits[pos], rtol=TOLERANCE, atol=TOLERANCE)


def test_a_step_without_adapter_rows_runs_no_lora_op(setup, monkeypatch):
    """With adapters loaded and slotted, a base-only step never calls the LoRA ops and gives the
    logits of a runner without LoRA."""
    from tandem.kernels import ops

    base, paths = setup
    runner = ModelRunner(base, num_blocks=16, block_size=BLOCK)
    plain = ModelRunner(base, num_blocks=16, block_size=BLOCK)
    lora = runner.enable_lora(max_loras=2, max_rank=16)
    lora.add("r4", paths["r4"])
    lora.slots_for(["r4"])

    def refused(*args):
        raise AssertionError("a LoRA op ran in a step without adapter rows")

    for name in ("lora_add",):
        monkeypatch.setattr(ops, name, refused)
    chunks = [SeqChunk([5, 6, 7, 8, 9], 0, [0, 1]), SeqChunk([10, 11], 0, [2])]
    assert torch.equal(runner.forward(chunks), plain.forward(chunks))


def test_fused_a_stacks_are_the_weights_extra_rows(setup):
    """fuse_into: each projection's weight is the first rows of one tensor whose others are its A
    stacks (a slot written lands there); the default rule leaves them apart where they would add
    more than FUSE_MOST_EXTRA of the rows (this tiny model's)."""
    from tandem.engine.lora_weights import FUSE_MOST_EXTRA

    base, paths = setup
    runner = ModelRunner(base, num_blocks=16, block_size=BLOCK)
    lora = runner.enable_lora(max_loras=2, max_rank=16, fuse=True)
    lora.add("r4", paths["r4"])
    slot = lora.slots_for(["r4"])["r4"]
    for layer, stacks in zip(runner.model.layers, lora.weights.layers):
        for proj, stack in stacks.items():
            weight = getattr(layer, proj).weight
            n = weight.shape[0]
            assert weight.data_ptr() == stack.weight.data_ptr() and stack.weight.shape[0] == n + stack.a.shape[0] * stack.a.shape[1]
            assert stack.a.data_ptr() == stack.weight[n:].data_ptr()
            assert torch.equal(stack.weight[n:].view_as(stack.a), stack.a)
    assert lora.weights.layers[0]["qkv_proj"].a[slot].abs().sum() > 0  # the adapter's A, in the fused rows
    plain = ModelRunner(base, num_blocks=16, block_size=BLOCK).enable_lora(max_loras=2, max_rank=16)
    first = plain.weights.layers[0]
    assert all(s.weight is None for s in first.values())
    assert 2 * 3 * 16 > runner.config.hidden_size * FUSE_MOST_EXTRA  # why: the rule's share


def test_fp8_weights_take_their_a_stacks_quantized_per_row(setup):
    """fuse_into on an FP8 model: each projection's Fp8Weight gains every slot's A as E4M3 rows with
    a scale per row (the module's data and scales are views of the first rows); writing and clearing a
    slot requantizes its rows; a step's logits with the shrinks in the FP8 matmul are those of the
    shrinks apart, within the rounding of A and x to E4M3, against the adapter's whole effect."""
    from tandem.engine.model import projection_weight
    from tandem.kernels.fp8_weight import Fp8Weight, dequantize

    base, paths = setup
    fused = ModelRunner(base, num_blocks=16, block_size=BLOCK, quantization="fp8")
    lora = fused.enable_lora(2, 16, fuse=True)
    apart = ModelRunner(base, num_blocks=16, block_size=BLOCK, quantization="fp8")
    apart_lora = apart.enable_lora(2, 16, fuse=False)
    for manager in (lora, apart_lora):
        manager.add("r4", paths["r4"])
    slot = lora.slots_for(["r4"])["r4"]
    assert apart_lora.slots_for(["r4"])["r4"] == slot
    for layer, stacks in zip(fused.model.layers, lora.weights.layers):
        for proj, stack in stacks.items():
            module = getattr(layer, proj)
            n = module.weight.shape[0]
            assert isinstance(stack.weight, Fp8Weight) and stack.weight.shape[0] == n + stack.a.shape[0] * stack.a.shape[1]
            assert module.weight.data_ptr() == stack.weight.data.data_ptr()
            assert module.weight_scale.data_ptr() == stack.weight.scale.data_ptr()
            assert isinstance(projection_weight(module), Fp8Weight)
            a_rows = dequantize(Fp8Weight(stack.weight.data[n:], stack.weight.scale[n:]))
            torch.testing.assert_close(a_rows.view_as(stack.a), stack.a.float(), rtol=2**-3, atol=1e-6)
    qkv = lora.weights.layers[0]["qkv_proj"]
    n, rows = qkv.weight.shape[0] - qkv.a.shape[0] * qkv.a.shape[1], qkv.a.shape[1]
    occupied = qkv.weight.data[n + slot * rows:n + (slot + 1) * rows].float()
    empty = qkv.weight.data[n + (1 - slot) * rows:n + (2 - slot) * rows].float()
    assert occupied.abs().sum() > 0 and empty.abs().sum() == 0  # the adapter's slot, and the other's
    prompt = list(range(3, 17))
    chunks = [SeqChunk(prompt, 0, [0, 1, 2, 3], lora_slot=slot)]
    with_fused, with_apart = fused.forward(chunks), apart.forward(chunks)
    base_logits = apart.forward([SeqChunk(prompt, 0, [4, 5, 6, 7])])
    effect = (with_apart - base_logits).abs().max()
    assert effect > 0.05
    assert (with_fused - with_apart).abs().max() < 0.1 * effect  # 2-4% on the tiny models
    lora.weights.clear(slot)
    first = lora.weights.layers[0]["qkv_proj"]
    n = first.weight.shape[0] - first.a.shape[0] * first.a.shape[1]
    rows = first.a.shape[1]
    assert first.weight.data[n + slot * rows:n + (slot + 1) * rows].float().abs().sum() == 0


def test_an_adapter_moved_to_another_slot_computes_the_same(setup):
    """Evicted by other adapters and brought back into a different slot: the same logits."""
    base, paths = setup
    runner = ModelRunner(base, num_blocks=32, block_size=BLOCK)
    lora = runner.enable_lora(max_loras=2, max_rank=16, max_cpu_loras=1)
    for name, path in paths.items():
        lora.add(name, path)
    prompt = list(range(3, 17))
    first = lora.slots_for(["r16"])["r16"]
    before = runner.forward([SeqChunk(prompt, 0, [0, 1, 2, 3], lora_slot=first)])
    lora.slots_for(["r4"])
    lora.slots_for(["r8", "r4"])  # r16, least recently used, is evicted (and dropped from the host)
    assert lora.slot_of("r16") is None and not lora.on_host("r16")
    again = lora.slots_for(["r16", "r8"])["r16"]  # r4 goes; r16 is read from its path again
    assert again != first
    after = runner.forward([SeqChunk(prompt, 0, [4, 5, 6, 7], lora_slot=again)])
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fuse", [False, True])
def test_on_the_gpu_beside_cuda_graphs(setup, fuse):
    """The Triton LoRA kernels in the engine on a GPU (fp32), CUDA graphs enabled: the CPU runner's
    tokens and logits. Decode steps with adapter rows replay the LoRA graphs (engine.cuda_graph),
    base-only ones the base graphs; a step mixing both equals the CPU's. ``fuse``: the GPU runner's
    A stacks under its weights (the skinny GEMM's LoRA finish, the slot-strided expands)."""
    base, paths = setup
    cpu, gpu = _runner(base, paths), _runner(base, paths, "cuda", fuse=fuse)
    gpu.enable_cuda_graphs(max_batch_size=8, max_seq_len=64)
    prompts = _prompts(cpu.config.vocab_size)
    on_cpu, on_gpu = _sequences(prompts), _sequences(prompts)
    _run_engine(cpu, on_cpu)
    _run_engine(gpu, on_gpu)
    for a, b in zip(on_cpu, on_gpu):
        assert a.tokens == b.tokens, f"adapter {a.adapter}"
        for pos, row in a.logits.items():
            torch.testing.assert_close(b.logits[pos].cpu(), row, rtol=1e-3, atol=1e-3)
    base_rows = [SeqChunk([s.tokens[-1]], len(s.tokens) - 1, s.block_ids) for s in on_gpu if s.adapter is None]
    lora_rows = [SeqChunk([s.tokens[-1]], len(s.tokens) - 1, s.block_ids, lora_slot=gpu.lora.slot_of(s.adapter))
                 for s in on_gpu if s.adapter is not None]
    cpu_rows = [SeqChunk([s.tokens[-1]], len(s.tokens) - 1, s.block_ids, lora_slot=cpu.lora.slot_of(s.adapter))
                for s in on_cpu if s.adapter is not None]
    assert gpu.graphs.can_run(base_rows) and gpu.graphs.can_run(lora_rows + base_rows)
    torch.testing.assert_close(gpu.forward(lora_rows + base_rows).cpu(),
                               cpu.forward(cpu_rows + [SeqChunk(c.token_ids, c.num_computed, c.block_ids)
                                                       for c in base_rows]), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_stacks_under_the_weights_on_the_gpu(setup):
    """FP8 weights on a GPU (bf16 activations), CUDA graphs enabled, every slot's A under its
    projection's FP8 rows (the shrinks in the FP8 matmuls, o's and down's LoRA in the skinny FP8
    finish, gate/up's in SiLU·mul) and apart: a prompt step and a decode step (graph replay) of three
    adapters and the base model give logits within the rounding of A and x to E4M3 of each other
    (a quarter of what the adapters change; the same steps on the CPU's bf16 references: 7-10%)."""
    base, paths = setup
    runners = {}
    for fuse in (True, False):
        runner = ModelRunner(base, num_blocks=96, block_size=BLOCK, device="cuda", dtype=torch.bfloat16,
                             quantization="fp8")
        lora = runner.enable_lora(max_loras=3, max_rank=16, fuse=fuse)
        for name, path in paths.items():
            lora.add(name, path)
        runner.enable_cuda_graphs(max_batch_size=8, max_seq_len=64)
        runners[fuse] = runner
    fused_stacks = [s.weight is not None for layer in runners[True].lora.weights.layers for s in layer.values()]
    assert all(fused_stacks) and not any(s.weight is not None for layer in runners[False].lora.weights.layers
                                         for s in layer.values())
    vocab = runners[True].config.vocab_size
    names = [*paths, None]
    prompts = [[(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(9 + i)] for i in range(len(names))]
    logits = {}
    for fuse, runner in runners.items():
        slots = runner.lora.slots_for(list(paths))
        ids = [slots[n] if n is not None else -1 for n in names]
        blocks = [list(range(6 * i, 6 * i + 6)) for i in range(len(names))]
        prompt = runner.forward([SeqChunk(p, 0, b, lora_slot=s) for p, b, s in zip(prompts, blocks, ids)])
        rows = [SeqChunk([5 + i], len(p), b, lora_slot=s) for i, (p, b, s) in enumerate(zip(prompts, blocks, ids))]
        assert runner.graphs.can_run(rows)
        decode = runner.forward(rows)
        base_rows = runner.forward([SeqChunk([5 + i], len(p), b) for i, (p, b) in enumerate(zip(prompts, blocks))])
        logits[fuse] = (prompt.float().cpu(), decode.float().cpu(), base_rows.float().cpu())
    effect = (logits[False][1] - logits[False][2]).abs().max()
    assert effect > 0.05
    for fused, apart in zip(logits[True][:2], logits[False][:2]):  # 7-10% in bf16 on the CPU's references
        assert (fused - apart).abs().max() < 0.25 * effect
