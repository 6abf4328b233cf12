"""A penalized stream whose decode worker is killed mid-stream: the other decode worker takes
the request with the tokens already streamed, fills its slot of counts from them, and the
client's one stream still equals HF generate() with the matching processors."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from tests.e2e.serve_cluster import Stream
from tests.engine.test_logits_process import OpenAIPenalties

pytestmark = pytest.mark.slow

MAX_TOKENS = 400
PROMPT = "The decode worker that holds this penalized request will be killed while it streams"
FIELDS = {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.2, "logit_bias": {"7": -3.0}}


def _hf(tiny_llama, prompt_ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the stream ignores EOS
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             repetition_penalty=FIELDS["repetition_penalty"], sequence_bias={(7,): -3.0},
                             logits_processor=LogitsProcessorList([OpenAIPenalties(
                                 len(prompt_ids), FIELDS["frequency_penalty"], FIELDS["presence_penalty"])]))
    return out[0, len(prompt_ids):].tolist()


def test_penalized_stream_survives_its_decode_worker_being_killed(two_decode_cluster, tiny_llama):
    cluster = two_decode_cluster
    client = Stream(cluster.base_url, os.path.basename(tiny_llama), PROMPT, MAX_TOKENS, ignore_eos=True)
    client.body.update(FIELDS)
    client.start()
    victim = cluster.kill_busy_worker("decode", lambda: len(client.arrivals) > 5)  # once tokens flow
    assert victim is not None, f"the request never ran: {client.error}\n{cluster.logs()}"
    tokens_at_kill = len(client.token_ids)
    client.join(120)
    assert client.status == 200 and client.done and client.error is None, client.error
    assert 0 < tokens_at_kill < MAX_TOKENS, "killed after the request had finished: the test proves nothing"
    expected = _hf(tiny_llama, AutoTokenizer.from_pretrained(tiny_llama)(PROMPT).input_ids)
    assert client.token_ids == expected
    assert len(set(expected)) > 50  # the penalties keep it off repeating itself
    cluster.wait_blocks_free("decode", "decode-1" if victim == "decode-0" else "decode-0")
