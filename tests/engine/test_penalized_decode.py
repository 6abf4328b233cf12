"""Penalized greedy decoding on the tiny model, the decode worker's way: token 0 from the
prompt's logits (``logits_process.first_token``), then ``DeviceSteps`` launching each step
before the previous one is read (its input tokens fed on the device, its penalty counts
updated there), equal to HF transformers' generate() with the matching processors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from tandem.cluster.messages import GenerateRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.cluster.step_stats import StepStats
from tandem.decode.device_steps import DeviceSteps
from tandem.decode.request import DecodeRequest
from tandem.engine.attention import SeqChunk
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.logits_process import first_token
from tandem.engine.runner import ModelRunner
from tandem.engine.sampler import sample
from tests.engine.test_logits_process import OpenAIPenalties

BLOCK = 4
NEW_TOKENS = 16
PROMPTS = [[1, 50, 60, 70, 80, 90], [1, 7, 7, 7, 300, 301, 302, 7, 9], [1, 400, 12]]


def _hf(model, prompt, params: SamplingParams) -> list[int]:
    kwargs = {}
    if params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in params.logit_bias}
    if params.frequency_penalty or params.presence_penalty:
        kwargs["logits_processor"] = LogitsProcessorList(
            [OpenAIPenalties(len(prompt), params.frequency_penalty, params.presence_penalty)])
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             **kwargs)
    return out[0, len(prompt):].tolist()


def _decode_run_ahead(runner, params: list[SamplingParams]) -> list[list[int]]:
    """Each prompt prefilled, token 0 sampled from its logits, then decode steps over all of them,
    every step launched before the previous one's tokens are read."""
    allocator = BlockAllocator(runner.kv_pool.num_blocks, BLOCK)
    steps = DeviceSteps(runner, allocator, StepStats("decode", 1e9))
    batch = []
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        blocks = allocator.allocate(len(prompt) + NEW_TOKENS)
        logits = runner.forward([SeqChunk(prompt, 0, blocks)])
        first = sample(first_token(logits, [p], [prompt]), [p], [0])[0]
        spec = GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=p, max_tokens=NEW_TOKENS,
                               reply_to="gw", ignore_eos=True)
        batch.append(DecodeRequest(spec=spec, status=RequestStatus.DECODING, block_ids=blocks,
                                   output_token_ids=[first]))
    previous = None
    for _ in range(NEW_TOKENS - 1):
        assert steps.launch(batch, previous) is None
        if previous is not None:  # read the step before, while this one is (on a GPU) still running
            for r, token in zip(previous.batch, steps.read(previous)):
                r.output_token_ids.append(token)
                r.num_pending -= 1
        previous = steps.in_flight
    for r, token in zip(previous.batch, steps.read(previous)):
        r.output_token_ids.append(token)
    return [r.output_token_ids for r in batch]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
    SamplingParams(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.6),
    SamplingParams(temperature=0.0, logit_bias=((510, -100.0), (186, -100.0), (223, 1.0), (5, 0.5))),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.2,
                   logit_bias=((186, -3.0),)),
], ids=["repetition", "presence_frequency", "logit_bias", "all"])
def test_penalized_run_ahead_decode_equals_hf_generate(tiny_checkpoints, params):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=BLOCK)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()
    plain = SamplingParams(temperature=0.0)
    # one plain row in the batch: its output is HF's plain greedy one
    ours = _decode_run_ahead(runner, [params, plain, params])
    for prompt, p, got in zip(PROMPTS, [params, plain, params], ours):
        want = _hf(model, prompt, p)
        assert got[:len(want)] == want, prompt  # HF stops at EOS; ours ignores it
        if p is params:
            assert want != _hf(model, prompt, plain)  # the processing changed the output
