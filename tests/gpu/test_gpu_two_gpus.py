"""`tandem serve` on two GPUs: prefill on one, decode on the other, nccl handoff; output equals HF."""

import os
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_serve_splits_prefill_and_decode_over_two_gpus(tmp_path):
    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.redis_server import free_port
    from tandem.engine.demo_model import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=32)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "serve", "--model", path, "--port", str(port), "--dtype", "float32",
         "--max-seq-len", "256", "--max-tokens-in-paged-kv-cache", "8192"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "wb"), text=True, start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving" in line, (tmp_path / "serve.err").read_text()[-3000:]
        tokenizer = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompt = "Once upon a time there was a small model that lived in a test directory."
        body = {"model": os.path.basename(path), "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "return_token_ids": True}
        got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
        ids = tokenizer(prompt).input_ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        assert got["choices"][0]["token_ids"] == ref
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
