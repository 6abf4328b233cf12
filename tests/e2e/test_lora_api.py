"""LoRA adapters loaded and unloaded at run time through a real cluster (redis-server, a prefill and
a decode worker, the gateway: the processes ``tandem serve`` starts), over vLLM's HTTP routes, the
gRPC admin API and ``tandem admin``.

Adapters are loaded while base-model streams run (every one finishes with HF's greedy tokens), listed
by /v1/models and the admin API; requests naming an adapter equal HF transformers + PEFT; an
adapter unloaded while a request streams with it lets that request finish (with the adapter's
tokens) while a new request naming it gets 404 ``model_not_found`` at once.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest
from transformers import AutoTokenizer

from tandem.gateway.admin import pb, pb_grpc
from tests.e2e.cluster import LocalCluster
from tests.e2e.serve_cluster import Stream, wait_tokens
from tests.gateway.conftest import wait_for
from tests.engine.lora_testing import make_peft_adapter, peft_greedy_generator

pytestmark = pytest.mark.slow

STREAM_TOKENS = 200  # long enough to be running while an adapter is unloaded
MAX_TOKENS = 16
PROMPTS = ["The history of the river begins in the mountains, where",
           "Three things every engineer should know about caches:"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"ada": make_peft_adapter(tiny_llama, root / "ada", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=1),
            "bea": make_peft_adapter(tiny_llama, root / "bea", 8, 16, "all-linear", seed=2, use_rslora=True),
            "big": make_peft_adapter(tiny_llama, root / "big", 32, 32, ["q_proj"], seed=3)}


@pytest.fixture(scope="module")
def lora_cluster(tiny_llama, tmp_path_factory):
    cluster = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp("logs")), "separate", tokens_per_block=4,
                           max_num_tokens=32, max_seq_len=256, max_input_len=50, enable_lora=True, max_loras=2,
                           max_lora_rank=16)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # two cores: the workers must not starve each other
        cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def greedy(tiny_llama, adapters):
    """HF + PEFT over the same weights, fp32 on the CPU: (adapter or None, prompt, n) -> up to n greedy
    tokens, ending at EOS (the requests ignore EOS: they go on after it, and ``agrees`` compares up to it)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    greedy = peft_greedy_generator(tiny_llama, {"ada": adapters["ada"], "bea": adapters["bea"]})
    return lambda adapter, prompt, max_new_tokens: greedy(adapter, tokenizer(prompt).input_ids, max_new_tokens)


def agrees(token_ids: list[int], expected: list[int]) -> bool:
    """A request's tokens (EOS ignored) equal HF's greedy ones up to HF's end (at least 8 of them)."""
    return len(expected) >= 8 and len(token_ids) >= len(expected) and token_ids[:len(expected)] == expected


def _admin(cluster: LocalCluster):
    channel = grpc.insecure_channel(cluster.admin_address)
    return channel, pb_grpc.AdminStub(channel)


def _complete(cluster: LocalCluster, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return httpx.post(f"{cluster.base_url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})


def _finished(stream: Stream, max_tokens: int) -> None:
    stream.join(180)
    assert not stream.is_alive() and stream.error is None and stream.status == 200, stream.error
    assert stream.done and stream.finish == "length" and len(stream.token_ids) == max_tokens


class BaseTraffic(threading.Thread):
    """Base-model streams one after another until stopped: (started, ended, prompt, stream) of each."""

    def __init__(self, cluster: LocalCluster, prompt: str):
        super().__init__(daemon=True)
        self._cluster, self._prompt = cluster, prompt
        self._stopping = threading.Event()
        self.streams: list[tuple[float, float, str, Stream]] = []

    def run(self) -> None:
        while not self._stopping.is_set():
            stream = Stream(self._cluster.base_url, self._cluster.settings.model_name, self._prompt, STREAM_TOKENS,
                            ignore_eos=True)
            started = time.monotonic()
            stream.run()  # in this thread
            self.streams.append((started, time.monotonic(), self._prompt, stream))
            if stream.error or stream.status != 200:
                return

    def stop(self) -> None:
        self._stopping.set()
        self.join(180)


def test_adapters_load_over_http_and_the_admin_api_while_base_streams_run(lora_cluster, adapters, greedy):
    base = lora_cluster.settings.model_name
    traffic = [BaseTraffic(lora_cluster, prompt) for prompt in PROMPTS]
    for thread in traffic:
        thread.start()
    assert wait_for(lambda: all(t.streams for t in traffic), timeout_s=60), "no base stream finished"
    loads = []  # (started, ended) of each load
    started = time.monotonic()
    loaded = httpx.post(f"{lora_cluster.base_url}/v1/load_lora_adapter", timeout=120,
                        json={"lora_name": "ada", "lora_path": adapters["ada"]})
    loads.append((started, time.monotonic()))
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'ada' added successfully."
    channel, admin = _admin(lora_cluster)
    with channel:
        started = time.monotonic()
        reply = admin.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="bea", path=adapters["bea"]), timeout=120)
        loads.append((started, time.monotonic()))
        assert (reply.adapter.name, reply.adapter.rank, reply.already_loaded) == ("bea", 8, False)
        refused = httpx.post(f"{lora_cluster.base_url}/v1/load_lora_adapter", timeout=120,
                             json={"lora_name": "big", "lora_path": adapters["big"]})
        assert refused.status_code == 400 and "--max-lora-rank (16)" in refused.json()["error"]["message"]
        listed = admin.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=10)
    time.sleep(0.3)  # a few more base streams after the loads
    for thread in traffic:
        thread.stop()
    assert listed.base_model == base and [(a.name, a.path) for a in listed.adapters] == [
        ("ada", adapters["ada"]), ("bea", adapters["bea"])]
    models = httpx.get(f"{lora_cluster.base_url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        (base, None, lora_cluster.settings.model), ("ada", base, adapters["ada"]), ("bea", base, adapters["bea"])]

    streams = [s for thread in traffic for s in thread.streams]
    for load_started, load_ended in loads:  # base streams ran while each adapter was loaded
        assert any(s_started < load_ended and s_ended > load_started for s_started, s_ended, _, _ in streams)
    expected = {prompt: greedy(None, prompt, STREAM_TOKENS) for prompt in PROMPTS}
    for _, _, prompt, stream in streams:  # every one finished with the base model's tokens
        assert stream.error is None and stream.status == 200 and stream.done, stream.error
        assert stream.finish == "length" and len(stream.token_ids) == STREAM_TOKENS
        assert agrees(stream.token_ids, expected[prompt])


def test_requests_naming_adapters_equal_peft(lora_cluster, greedy):
    base = lora_cluster.settings.model_name
    answers = {}
    for model in ("ada", "bea", base):
        response = _complete(lora_cluster, model, PROMPTS[0])
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        answers[model] = response.json()["choices"][0]["token_ids"]
    assert agrees(answers["ada"], greedy("ada", PROMPTS[0], MAX_TOKENS))
    assert agrees(answers["bea"], greedy("bea", PROMPTS[0], MAX_TOKENS))
    assert len({tuple(t) for t in answers.values()}) == 3, answers  # each adapter changes the output


def test_an_adapter_unloaded_while_a_request_streams_with_it(lora_cluster, adapters, greedy, capsys):
    from tandem.cli import build_parser
    from tandem.gateway import admin_client

    stream = Stream(lora_cluster.base_url, "ada", PROMPTS[1], STREAM_TOKENS, ignore_eos=True)
    stream.start()
    wait_tokens([stream], 2)
    unloaded = httpx.post(f"{lora_cluster.base_url}/v1/unload_lora_adapter", json={"lora_name": "ada"}, timeout=30)
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'ada' removed successfully."
    running_at_unload = not stream.done
    gone = _complete(lora_cluster, "ada", PROMPTS[0])  # a new request naming it: at once
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert running_at_unload, "the stream ended before the unload: the test proves nothing"
    _finished(stream, STREAM_TOKENS)  # the request running with it finished, with it
    assert agrees(stream.token_ids, greedy("ada", PROMPTS[1], STREAM_TOKENS))

    again = httpx.post(f"{lora_cluster.base_url}/v1/unload_lora_adapter", json={"lora_name": "ada"}, timeout=30)
    assert again.status_code == 404 and again.json()["error"]["code"] == "lora_adapter_not_found"
    capsys.readouterr()
    assert admin_client.main(build_parser().parse_args(
        ["admin", "--address", lora_cluster.admin_address, "lora-unload", "bea"])) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "bea"
    assert [m["id"] for m in httpx.get(f"{lora_cluster.base_url}/v1/models").json()["data"]] == [
        lora_cluster.settings.model_name]
    # loaded again under the same name: served again at once
    assert admin_client.main(build_parser().parse_args(
        ["admin", "--address", lora_cluster.admin_address, "lora-load", "ada", adapters["ada"]])) == 0
    started = time.monotonic()
    response = _complete(lora_cluster, "ada", PROMPTS[0])
    assert response.status_code == 200, response.text
    assert agrees(response.json()["choices"][0]["token_ids"], greedy("ada", PROMPTS[0], MAX_TOKENS))
    assert time.monotonic() - started < 60
