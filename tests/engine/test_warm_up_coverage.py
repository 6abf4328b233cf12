"""The worker's warm-up compiles every attention binary that steps of traffic launch.

A colocated worker's steps with prompt chunks run their attention eagerly, between CUDA-graph
pieces (``engine.mixed_graph``); each Triton launch there is compiled for its key (the
constexprs and launch options its shape rules pick, and the specialization of every other
argument: ``tests/kernels/launch_keys.py``). A key the warm-up (``warm_up_prefill``, then
``warm_up_mixed``) never launched compiles inside a step of real traffic, for half a second or
more, and every stream of the batch waits for it. Here the warm-up and a few hundred random
steps of each benchmark shape (decode rows, new prompts, prompts continued in chunks) run
through the model's own attention dispatch with the llama3-8b geometry and an H100's / H200's
132 SMs; the kernels are recorded, not run, and every key the traffic launches must be one
the warm-up launched.
"""

from __future__ import annotations

import importlib
import random
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import pytest
import torch

from tandem.engine.attention import SeqChunk, build_metadata
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.kv_cache import KVCachePool
from tandem.engine.model import DecoderLayer
from tandem.engine.runner import ModelRunner
from tandem.engine.warmup import QUERY_LENGTHS, warm_up_adapters, warm_up_mixed, warm_up_prefill
from tandem.kernels import decode_attention, decode_config, fp8_matmul, lora, ops, prefill_attention
from tests.kernels.launch_keys import recording, unlike

BLOCK = 16
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # llama3-8b
SMS = 132  # H100 and H200
STEPS = 300

# (max batch, token budget, sequence limit, prompt length, longest context): `bash scripts/gpu.sh
# offline`'s rows (tandem.bench.cluster_mixed's limits: the sequence limit at least 1,024), and
# short chats whose steps hold only a few blocks a row
SHAPES = {
    "c256": (256, 2048, 1024, 128, 256),
    "offline_128": (1024, 8192, 1024, 128, 256),
    "offline_1000": (1024, 8192, 2048, 1000, 2000),
    "short_chats": (1024, 8192, 1024, 16, 48),
}


@pytest.fixture
def gpu_dispatch(monkeypatch):
    """The GPU's dispatch and shape rules on the CPU: every op through its Triton launcher (the
    kernels recorded, not run: ``recording``), the GEMV and skinny GEMM routes, 132 SMs."""
    monkeypatch.setattr(decode_config, "num_sms", lambda device: SMS)
    monkeypatch.setattr(ops, "_triton_layout", lambda x, weight, bias: x.dim() == 2 and x.shape[0] > 0)
    monkeypatch.setattr(ops, "_pick", lambda name, tensor: ops._triton_impl(name) or getattr(ops.reference, name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    # FP8 weights take the FP8 tensor-core routes (bf16 rows; torch's scaled matmul, cuBLAS, stood in)
    monkeypatch.setattr(fp8_matmul, "takes", lambda x, weight: x.dtype == torch.bfloat16 and weight.shape[1] % 16 == 0
                        and weight.shape[0] % 16 == 0)
    monkeypatch.setattr(fp8_matmul, "scaled_mm", lambda x_q, x_scale, weight, bias, out_dtype: torch.zeros(
        x_q.shape[0], weight.shape[0], dtype=out_dtype))


class _EveryKernel:
    """The launches of every kernel of every op's module, while ``recording``."""

    def __init__(self, recorded):
        self.recorded = recorded

    def distinct(self) -> set[tuple]:
        return set().union(*(r.distinct() for r in self.recorded))

    def clear(self) -> None:
        for r in self.recorded:
            r.keys.clear()


@contextmanager
def every_kernel_recorded():
    modules = {importlib.import_module(m) for m in ops._TRITON_MODULES.values()}
    with ExitStack() as stack:
        yield _EveryKernel([stack.enter_context(recording(m, *_jit_kernels(m))) for m in modules])


def _jit_kernels(module) -> list[str]:
    return [name for name, value in vars(module).items()
            if name.endswith("_kernel") and hasattr(value, "fn") and hasattr(value, "__getitem__")]


def _missed(what: str, traffic: set[tuple], warmed: set[tuple]) -> str:
    missed = traffic - warmed
    return (f"{len(missed)} of {len(traffic)} binaries that {what} launch compile while serving "
            f"({len(warmed)} warmed up), e.g.:\n" + "\n".join(sorted(unlike(k, warmed) for k in missed)[:8]))


class _AttentionRunner:
    """``forward`` as a step with prompt chunks runs on the GPU (``MixedGraphs.forward``): the
    step's metadata built on the host, q, k and v in static buffers, then the layer's attention
    dispatch (``DecoderLayer.attend``); one layer, the rest of the model left out."""

    def __init__(self, pool: KVCachePool, max_num_tokens: int):
        self.device = torch.device("cpu")
        self.dtype = torch.bfloat16
        self.config = SimpleNamespace(num_layers=1, layer_sliding_window=lambda layer: None)
        self.lora = None  # no LoRA slots
        self.kv_pool = pool
        self.layer = SimpleNamespace(layer_idx=0, scale=HEAD_DIM ** -0.5, sliding_window=None)
        self.q = torch.empty(max_num_tokens, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        self.k = torch.empty(max_num_tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        self.v = torch.empty_like(self.k)
        self.attn = torch.empty(max_num_tokens, Q_HEADS * HEAD_DIM, dtype=torch.bfloat16)

    def warm_up_logits(self, max_rows: int) -> None:
        pass  # no lm_head here: the model's logits are the other tests'

    def forward(self, chunks: list[SeqChunk]) -> None:
        meta = build_metadata(chunks, BLOCK, self.device)
        n = meta.num_tokens
        q, k, v = self.q[:n], self.k[:n], self.v[:n]
        DecoderLayer.attend(self.layer, q, k, v, self.kv_pool, meta, out=self.attn[:n].view(q.shape))


def _traffic(rng: random.Random, max_batch: int, budget: int, prompt_len: int, longest: int,
             num_blocks: int) -> list[list[SeqChunk]]:
    """Steps of decode rows (each at a context its request could reach) followed by prompt chunks
    (new prompts, and prompts continued past an earlier chunk), within the token budget."""
    steps = []
    for _ in range(STEPS):
        chunks = []
        num_decode = rng.choice([0, rng.randint(1, max_batch), max_batch])
        num_decode = min(num_decode, budget - 1)
        for _ in range(num_decode):
            context = rng.randint(1, longest - 1)
            chunks.append(SeqChunk([1], context, _blocks(rng, context + 1, longest, num_blocks)))
        room = budget - num_decode
        while room > 0:
            done = rng.choice([0, 0, rng.randint(1, prompt_len - 1)])
            length = min(rng.randint(1, prompt_len - done), room)
            chunks.append(SeqChunk([1] * length, done, _blocks(rng, done + length, longest, num_blocks)))
            room -= length
            if rng.random() < 0.3:  # a step the waiting prompts do not fill
                break
        steps.append(chunks)
    return steps


def _blocks(rng: random.Random, tokens: int, longest: int, num_blocks: int) -> list[int]:
    """A request's block ids: those its tokens fill, or (reserved ahead) up to the longest context."""
    needed = -(-tokens // BLOCK)
    count = rng.choice([needed, rng.randint(needed, max(needed, -(-longest // BLOCK)))])
    return [rng.randrange(num_blocks) for _ in range(count)]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8_kv", "bf16_kv"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_steps_of_traffic_launch_only_what_the_warm_up_compiled(monkeypatch, gpu_dispatch, shape, kv_dtype):
    max_batch, budget, max_seq_len, prompt_len, longest = SHAPES[shape]
    num_blocks = -(-max_seq_len // BLOCK) + 2
    scales = {"k_scale": torch.ones(1, KV_HEADS), "v_scale": torch.ones(1, KV_HEADS)} if kv_dtype.itemsize == 1 else {}
    pool = KVCachePool(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype, **scales)
    runner = _AttentionRunner(pool, budget)
    kernels = ("_decode_partial_kernel", "_decode_reduce_kernel")
    with recording(decode_attention, *kernels) as decode, \
            recording(prefill_attention, "_prefill_attention_kernel") as prefill:
        monkeypatch.setattr(ops, "gather_blocks", lambda kv, ids, out=None: None)  # not attention
        monkeypatch.setattr(ops, "scatter_blocks", lambda kv, ids, blocks: None)
        allocator = BlockAllocator(num_blocks, BLOCK)
        warm_up_prefill(runner, allocator, budget, force=True)
        warm_up_mixed(runner, allocator, max_batch, max_seq_len, budget, force=True)
        warmed = decode.distinct() | prefill.distinct()
        decode.keys.clear()
        prefill.keys.clear()
        for chunks in _traffic(random.Random(7), max_batch, budget, prompt_len, longest, num_blocks):
            runner.forward(chunks)
        traffic = decode.distinct() | prefill.distinct()
    assert traffic <= warmed, _missed("steps of traffic", traffic, warmed)


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16", "fp8"])
def test_eager_prompt_steps_launch_only_what_the_prefill_warm_up_compiled(gpu_dispatch, tiny_checkpoints,
                                                                         quantization):
    """A prefill worker's steps run every kernel eagerly, for any number of tokens: the warm-up's
    forwards compile every binary that steps of 1 .. 600 tokens in 1 .. 40 prompts launch (a
    prompt's chunk of one token at the head of a step attends as a decode row; the logits are a
    row a prompt)."""
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=128, block_size=BLOCK, dtype=torch.bfloat16,
                         quantization=quantization)
    with every_kernel_recorded() as launches:
        allocator = BlockAllocator(128, BLOCK)
        warm_up_prefill(runner, allocator, 2048, force=True)  # as the prefill worker does
        warm_up_mixed(runner, allocator, 8, 512, 2048, force=True)  # the tiny model's 512 positions
        warmed = launches.distinct()
        launches.clear()
        rng = random.Random(3)
        for _ in range(60):
            chunks, tokens = [], 0
            count = rng.choice([rng.randint(1, 8), rng.randint(9, 40)])
            for _ in range(count):
                length = rng.randint(1, 75 if count <= 8 else 12)
                blocks = allocator.allocate(length)
                chunks.append(SeqChunk([1] * length, 0, blocks))
                tokens += length
            runner.forward(chunks)
            for chunk in chunks:
                allocator.free(chunk.block_ids)
        traffic = launches.distinct()
    assert traffic <= warmed, _missed("prompt steps", traffic, warmed)


@pytest.mark.parametrize("quantization, fuse", [(None, None), (None, True), ("fp8", None), ("fp8", True)],
                         ids=["bf16", "bf16-fused", "fp8", "fp8-fused"])
def test_eager_steps_with_adapter_rows_launch_only_what_the_warm_up_compiled(monkeypatch, gpu_dispatch,
                                                                            tiny_checkpoints, tmp_path, quantization,
                                                                            fuse):
    """A step whose rows carry adapters runs eagerly (decode rows and prompt chunks of any mix of
    adapters and the base model): the worker's warm-up compiles every binary such steps launch,
    the A stacks apart or under the weights (LoraWeights.fuse_into)."""
    from lora_testing import make_peft_adapter

    base = tiny_checkpoints["llama"]
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    monkeypatch.setattr(lora, "_num_sms", lambda device: SMS)
    monkeypatch.setattr(lora, "_split_k", lambda x, programs, k_blocks: max(1, min(k_blocks // 4, 2 * SMS // programs)))
    runner = ModelRunner(base, num_blocks=128, block_size=BLOCK, dtype=torch.bfloat16, quantization=quantization)
    manager = runner.enable_lora(max_loras=4, max_rank=16, fuse=fuse)
    manager.add("wide", make_peft_adapter(base, tmp_path / "wide", 16, 32, every, seed=1))
    manager.add("narrow", make_peft_adapter(base, tmp_path / "narrow", 8, 8, ["q_proj", "down_proj"], seed=2))
    slots = list(manager.slots_for(["wide", "narrow"]).values()) + [-1]
    with every_kernel_recorded() as launches:
        allocator = BlockAllocator(128, BLOCK)
        warm_up_prefill(runner, allocator, 2048, force=True)  # as the worker of both pools does
        assert warm_up_adapters(runner, allocator, 2048, force=True) == 12
        warm_up_mixed(runner, allocator, 64, 512, 2048, force=True)
        warmed = launches.distinct()
        launches.clear()
        rng = random.Random(5)
        for _ in range(60):
            chunks = []
            for _ in range(rng.choice([0, rng.randint(1, 64)])):
                context = rng.randint(1, 200)
                chunks.append(SeqChunk([1], context, _blocks(rng, context + 1, 256, 128), lora_slot=rng.choice(slots)))
            for _ in range(rng.randint(0 if chunks else 1, 6)):
                length = rng.randint(2, 75)
                chunks.append(SeqChunk([1] * length, 0, _blocks(rng, length, 256, 128), lora_slot=rng.choice(slots)))
            runner.forward(chunks)
        traffic = launches.distinct()
    assert traffic <= warmed, _missed("steps with adapter rows", traffic, warmed)


@pytest.mark.parametrize("projection", ["qkv_proj", "down_proj"])
def test_lora_launches_of_any_rows_and_adapters_are_the_warm_ups(monkeypatch, projection):
    """The LoRA kernels at llama3-8b's shapes (rank 16), for 1 .. 2,048 adapter rows over 1 .. 8
    adapters, launch only binaries that ``warm_up_adapters``' single-adapter steps of 1 .. 256 rows
    launched, splits of K included (the tiny models' K never splits): qkv's lora_add, down's shrink
    alone (its expand is in the norm after it, kernels.lora_rows; up to 64 splits)."""
    monkeypatch.setattr(lora, "_num_sms", lambda device: SMS)
    monkeypatch.setattr(lora, "_split_k", lambda x, programs, k_blocks: max(1, min(k_blocks // 4, 2 * SMS // programs)))
    K, N, parts = (4096, 6144, [0, 4096, 5120]) if projection == "qkv_proj" else (14336, 4096, [0])
    a = torch.empty(8, 16 * len(parts), K, dtype=torch.bfloat16)
    b = torch.empty(8, N, 16, dtype=torch.bfloat16)
    scales = torch.ones(len(parts), 8)

    def launch(num_rows: int, num_adapters: int) -> None:
        x, y = torch.empty(num_rows, K, dtype=torch.bfloat16), torch.empty(num_rows, N, dtype=torch.bfloat16)
        bounds = [num_rows * i // num_adapters for i in range(num_adapters + 1)]
        segments = (torch.arange(num_rows), torch.tensor(bounds, dtype=torch.int32),
                    torch.arange(num_adapters, dtype=torch.int32))
        if projection == "qkv_proj":
            lora.lora_add(y, x, a, b, parts, scales, *segments)
        else:
            lora.lora_partials(x, a, *segments)

    with recording(lora, "_lora_shrink_kernel", "_lora_expand_kernel") as launches:
        for rows in QUERY_LENGTHS:
            launch(rows, 1)
        warmed = launches.distinct()
        rng = random.Random(11)
        for _ in range(200):
            num_adapters = rng.randint(1, 8)
            launch(rng.randint(num_adapters, 2048), num_adapters)
        traffic = launches.distinct()
    assert traffic <= warmed, _missed("LoRA steps", traffic, warmed)


def test_penalized_rows_of_any_step_launch_only_what_the_warm_up_compiled(gpu_dispatch):
    """``warm_up_penalties``' one scratch row compiles the binary that every later penalized step
    launches: first tokens of 1 .. 8 prompts (counts made for the step), and decode steps of any
    rows over the worker's slots of counts and prompt marks."""
    from tandem.cluster.sampling import SamplingParams
    from tandem.engine import logits_process
    from tandem.engine.penalty_slots import PenaltySlots
    from tandem.engine.warmup import warm_up_penalties
    from tandem.kernels import penalties

    vocab = 1000
    runner = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(vocab_size=vocab))
    slots = PenaltySlots(vocab, torch.device("cpu"))
    with recording(penalties, "_penalties_kernel") as launches:
        assert warm_up_penalties(runner, force=True)
        warmed = launches.distinct()
        rng = random.Random(13)
        for _ in range(20):
            n = rng.randint(1, 8)
            params = [SamplingParams(repetition_penalty=1.2, presence_penalty=rng.choice([0.0, 0.5])) for _ in range(n)]
            logits_process.first_token(torch.zeros(n, vocab), params, [[1, 2, 3]] * n)
            keys = [f"request-{i}" for i in range(n)]
            rows = slots.reset(keys, [[1, 2]] * n, [[3]] * n)
            plan = logits_process.plan(params, vocab, torch.device("cpu"), dict(enumerate(rows)))
            logits_process.apply(torch.zeros(n, vocab), plan, slots.counts, slots.prompt)
        traffic = launches.distinct()
    assert len(launches.keys) == 41 and traffic <= warmed, _missed("penalized steps", traffic, warmed)


def test_a_decode_step_with_adapters_launches_two_kernels_a_layer_more_than_the_base_step(
        monkeypatch, gpu_dispatch, tiny_checkpoints, tmp_path):
    """With the A stacks under the weights (LoraWeights.fuse_into), a decode step whose rows all
    carry an adapter of every projection launches at most 2 kernels a layer more than the base
    step (qkv's expand, and SiLU·mul apart from its GEMM): the shrinks are the projections' extra
    rows, o's and down's LoRA rides their add-norm finish and gate/up's the SiLU·mul. Apart, it
    launches more (4 shrinks a layer)."""
    from lora_testing import make_peft_adapter

    base = tiny_checkpoints["llama"]
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    counts = {}
    for fuse in (True, False):
        runner = ModelRunner(base, num_blocks=128, block_size=BLOCK, dtype=torch.bfloat16)
        manager = runner.enable_lora(max_loras=2, max_rank=16, fuse=fuse)
        manager.add("wide", make_peft_adapter(base, tmp_path / f"wide{fuse}", 16, 32, every, seed=1))
        slot = manager.slots_for(["wide"])["wide"]
        rng = random.Random(3)
        contexts = [rng.randint(1, 200) for _ in range(16)]
        for lora_slot in (-1, slot):
            chunks = [SeqChunk([1], c, _blocks(rng, c + 1, 256, 128), lora_slot=lora_slot) for c in contexts]
            with every_kernel_recorded() as launches:
                runner.forward(chunks)
            counts[fuse, lora_slot >= 0] = sum(len(r.keys) for r in launches.recorded)
    layers = runner.config.num_layers
    assert counts[True, False] == counts[False, False]  # the base step is the same either way
    assert counts[True, True] - counts[True, False] <= 2 * layers, counts  # the tiny model: 20 and 24
    assert counts[False, True] > counts[True, True], counts
