import pytest
import torch

from tandem.engine.demo_model import make_tiny_checkpoint
from tests.e2e.cluster import LocalCluster


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def pytest_generate_tests(metafunc):
    """A test module naming ``LAYOUTS`` runs its ``cluster`` tests in each of them."""
    layouts = getattr(metafunc.module, "LAYOUTS", None)
    if layouts and "cluster" in metafunc.fixturenames:
        metafunc.parametrize("cluster", layouts, indirect=True, scope="module")


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory, request):
    # small blocks and a small prefill budget so prompts span several chunks and blocks (and,
    # colocated, share steps with decode rows); decode steps run ahead (each launched before
    # the previous one is read), as on a GPU
    layout = getattr(request, "param", "separate")
    c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp("logs")), layout, tokens_per_block=4,
                     max_num_tokens=16, max_seq_len=256, max_input_len=200, decode_run_ahead="on").start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def hf_greedy(tiny_llama):
    """HF transformers generate() on the same weights: the reference output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        return out[0, len(prompt_ids):].tolist()

    return generate


@pytest.fixture(scope="session")
def hf_greedy_logprobs(tiny_llama):
    """HF generate() on the same weights -> (tokens, log-softmax of each step's raw logits [n, V])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_new_tokens: int):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 output_logits=True, return_dict_in_generate=True)
        logits = torch.cat(out.logits)  # [new tokens, V]
        return out.sequences[0, len(prompt_ids):].tolist(), torch.log_softmax(logits.float(), dim=-1)

    return generate


@pytest.fixture
def two_decode_cluster(tiny_llama, tmp_path):
    """Two decode workers (a request can fail over from one to the other), one prefill worker."""
    c = LocalCluster(tiny_llama, str(tmp_path), tokens_per_block=4, max_num_tokens=64, max_seq_len=512)
    c.start_two_decode()
    yield c
    c.stop()
