"""Several hosts on one machine (Linux network namespaces, ``tests/e2e/netns.py``): Redis, the
gateway, a prefill worker and two decode workers each on a host of its own, KV moving between
them over the ``nccl`` transport (gloo on the CPU). Concurrent greedy streams equal HF
generate(); then the decode host holding requests loses its link mid-stream: its requests
resume on the other decode host and still equal HF (or end with an error event), nothing
hangs, everything else stays up, and the surviving pool gets every block back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import redis

from tandem.cluster import keys
from tandem.cluster.messages import decode
from tandem.cluster.settings import Settings
from tandem.launcher import service_argv, wait_healthy
from tests.e2e import netns

pytestmark = pytest.mark.slow

HOSTS = ["redis", "gateway", "prefill", "decode0", "decode1"]
DECODE_HOSTS = ["decode0", "decode1"]
REDIS_PORT, GATEWAY_PORT = 6379, 8000  # each host has its own ports: no clash with anything else
PROMPTS = [
    "Hello world!",
    "A serving system reads the prompt, computes the keys and values of every token, then writes one new token",
    "The quick brown fox jumps over the lazy dog",
    "Prefill and decode run on different hosts",
    "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve",
    "KV blocks cross the network between namespaces",
    "What is the capital of France?",
    "Every stream must end, whatever happens to the link",
]
MAX_TOKENS = 24
FAILOVER_MAX_TOKENS = 200  # long enough to be mid-stream when the link goes
STREAM_BOUND_S = 60.0  # every stream ends within this after the link is cut


def _skip_reason() -> str | None:
    if shutil.which("redis-server") is None:
        return "no redis-server"
    return netns.unavailable()


@pytest.fixture
def network(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(f"no network namespaces for a multi-host test: {reason}")
    net = netns.Network(HOSTS)
    try:
        yield net
    finally:
        net.close()


class Hosts:
    """The cluster's processes, each started in its host with the production command line."""

    def __init__(self, net: netns.Network, model: str, log_dir: str):
        self.net, self.log_dir = net, log_dir
        self.redis_url = f"redis://{net.hosts['redis']}:{REDIS_PORT}/0"
        self.base_url = f"http://{net.hosts['gateway']}:{GATEWAY_PORT}"
        self.settings = Settings(
            model=model, redis_url=self.redis_url, host=net.hosts["gateway"], port=GATEWAY_PORT, admin_port=0,
            device="cpu", kv_transport="nccl", tokens_per_block=4, max_num_tokens=16, max_seq_len=256,
            heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0, cpu_threads=1,
        ).resolve()
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis = redis.Redis.from_url(self.redis_url, socket_timeout=5)

    def start(self) -> None:
        data_dir = os.path.join(self.log_dir, "redis-data")
        os.makedirs(data_dir, exist_ok=True)
        argv = ["redis-server", "--port", str(REDIS_PORT), "--bind", self.net.hosts["redis"], "--protected-mode", "no",
                "--save", "", "--appendonly", "no", "--dir", data_dir]
        self._popen("redis", argv, stop_last=True)  # the services still talk to it as they stop
        deadline = time.monotonic() + 15
        while True:
            try:
                self.redis.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.procs["redis"].poll() is not None:
                    raise RuntimeError(f"redis-server did not answer at {self.redis_url}\n{self.logs()}")
                time.sleep(0.1)
        for worker_id in DECODE_HOSTS:
            self._service("decode", worker_id)
        self._service("prefill", "prefill")
        self._service("gateway", "gateway")
        if not wait_healthy(f"{self.base_url}/health", list(self.procs.values()), 180):
            raise RuntimeError(f"the cluster did not become healthy\n{self.logs()}")
        deadline = time.monotonic() + 30
        while not all(self.worker("decode", w) for w in DECODE_HOSTS):
            assert time.monotonic() < deadline, f"a decode worker never registered\n{self.logs()}"
            time.sleep(0.1)

    def _service(self, role: str, host: str) -> None:
        worker_id = None if role == "gateway" else host
        env = dict(os.environ, OMP_NUM_THREADS="1", TANDEM_KV_HOST=self.net.hosts[host],
                   TANDEM_KV_TRACE=os.path.join(self.log_dir, f"{host}-kv-trace.json"))
        self._popen(host, service_argv(role, self.settings, worker_id), env=env)

    def _popen(self, host: str, argv: list[str], env: dict | None = None, stop_last: bool = False) -> None:
        with open(os.path.join(self.log_dir, f"{host}.log"), "ab") as log:
            self.procs[host] = self.net.popen(host, argv, stop_last=stop_last, stdout=log,
                                              stderr=subprocess.STDOUT, env=env)

    def worker(self, role: str, worker_id: str):
        raw = self.redis.get(keys.worker(role, worker_id))
        return decode(raw) if raw else None

    def wait_blocks_free(self, worker_id: str, timeout_s: float = 15.0):
        deadline, info = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            info = self.worker("decode", worker_id)
            if info and info.num_free_blocks == info.num_total_blocks and info.num_running == 0:
                return info
            time.sleep(0.1)
        raise AssertionError(f"{worker_id} still holds blocks: {info}\n{self.logs()}")

    def pairs(self, host: str) -> str:
        """The established TCP connections of a host (the nccl control sockets among them)."""
        return subprocess.run(["ip", "netns", "exec", self.net.namespaces[host], "ss", "-tnH", "state",
                               "established"], check=False, capture_output=True, text=True, timeout=10).stdout

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.log_dir)):
            if name.endswith(".log"):
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    out.append(f"--- {name}\n" + f.read()[-4000:])
        return "\n".join(out)


def _stream(base_url: str, model: str, prompt: str, max_tokens: int, out: dict) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    out.update(token_ids=[], finish=None, done=False, chunks=0, error=None)
    try:
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(STREAM_BOUND_S * 2)) as client:
            with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
                out["status"] = resp.status_code
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        out["done"] = True
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        out["error"] = event["error"]
                    for choice in event.get("choices") or []:
                        out["token_ids"] += choice.get("token_ids") or []
                        out["finish"] = choice.get("finish_reason") or out["finish"]
                    out["chunks"] += 1
    except Exception as exc:  # reported by the assertions
        out["exception"] = repr(exc)
    out["ended_at"] = time.monotonic()


def _start_streams(base_url: str, model: str, max_tokens: int) -> tuple[list[threading.Thread], list[dict]]:
    outs = [{} for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(base_url, model, p, max_tokens, o), daemon=True)
               for p, o in zip(PROMPTS, outs)]
    for t in threads:
        t.start()
    return threads, outs


def _join(threads: list[threading.Thread], bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))


def test_hosts_in_namespaces_serve_over_nccl_and_survive_a_lost_decode_link(network, tiny_llama, hf_greedy,
                                                                              tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    # the references first: the cluster's processes need the two cores afterwards
    expected = [hf_greedy(ids, MAX_TOKENS) for ids in prompt_ids]
    expected_long = [hf_greedy(ids, FAILOVER_MAX_TOKENS) for ids in prompt_ids]

    cluster = Hosts(network, tiny_llama, str(tmp_path))
    cluster.start()
    model = cluster.settings.model_name
    addresses = network.hosts

    # every decode pool is an nccl (gloo) endpoint on its own host's address
    for host in DECODE_HOSTS:
        endpoint = cluster.worker("decode", host).kv_endpoint
        assert (endpoint["transport"], endpoint["backend"], endpoint["host"]) == ("nccl", "gloo", addresses[host])

    # 1. eight concurrent greedy streams, KV from the prefill host to both decode hosts
    threads, outs = _start_streams(cluster.base_url, model, MAX_TOKENS)
    _join(threads, STREAM_BOUND_S)
    assert not any(t.is_alive() for t in threads), f"streams still open: {outs}\n{cluster.logs()}"
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert out.get("status") == 200 and out["done"] and not out["error"] and "exception" not in out, (
            f"{prompt!r}: {out}\n{cluster.logs()}")
        assert out["token_ids"] == want, prompt
    # the prefill host holds control connections to the decode hosts' nccl endpoints
    prefill_pairs = cluster.pairs("prefill")
    paired = [h for h in DECODE_HOSTS
              if f"{addresses[h]}:{cluster.worker('decode', h).kv_endpoint['ctrl_port']}" in prefill_pairs]
    assert paired, f"no nccl control connection from the prefill host:\n{prefill_pairs}"

    # 2. the decode host holding the most requests loses its link while they decode
    threads, outs = _start_streams(cluster.base_url, model, FAILOVER_MAX_TOKENS)
    victim, running, deadline = None, 0, time.monotonic() + 60
    while running == 0 and time.monotonic() < deadline:
        if all(o.get("chunks", 0) > 5 or o.get("done") for o in outs):
            # the registry's counts come with each worker's heartbeat: read until one shows the streams
            counts = {h: cluster.worker("decode", h).num_running for h in DECODE_HOSTS}
            victim = max(counts, key=counts.get)
            running = counts[victim]
        time.sleep(0.02)
    assert victim is not None and running > 0, f"no decode host held a request: {outs}\n{cluster.logs()}"
    survivor = next(h for h in DECODE_HOSTS if h != victim)
    network.link_down(victim)
    cut_at = time.monotonic()
    tokens_at_cut = [len(o["token_ids"]) for o in outs]
    _join(threads, STREAM_BOUND_S)
    hung = [(p, o) for p, o, t in zip(PROMPTS, outs, threads) if t.is_alive()]
    assert not hung, f"streams did not end within {STREAM_BOUND_S:g}s of the cut: {hung}\n{cluster.logs()}"
    ended = []
    for prompt, out, want in zip(PROMPTS, outs, expected_long):
        assert out.get("status") == 200 and out["done"] and "exception" not in out, (
            f"{prompt!r}: {out}\n{cluster.logs()}")
        ended.append(out["ended_at"] - cut_at)
        if out["error"] is None:  # resumed on the survivor (or never on the victim): the uninterrupted output
            assert out["token_ids"] == want, prompt
    assert any(n < FAILOVER_MAX_TOKENS for n in tokens_at_cut), "the cut came after every stream finished"
    failed = [o["error"] for o in outs if o["error"]]
    metrics = httpx.get(f"{cluster.base_url}/metrics", trust_env=False).text
    failovers = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("tandem_gateway_failovers_total "))
    assert failovers + len(failed) >= 1, "the lost host's requests neither failed over nor failed"

    # everything but the lost host is alive, and a later request is served
    for host in ("redis", "gateway", "prefill", survivor):
        assert cluster.procs[host].poll() is None, f"{host} exited\n{cluster.logs()}"
    assert cluster.worker("decode", victim) is None  # its record expired with its heartbeats
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True}
    resp = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=60, trust_env=False)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == expected[2]
    cluster.wait_blocks_free(survivor)

    # the link comes back: the lost host registers again and, told to abort the requests it lost
    # (the gateway's aborts wait in its inbox), gives every block back
    network.link_up(victim)
    cluster.wait_blocks_free(victim, timeout_s=30)

    # the survivor received KV chunks over the pair and acked them (its trace, written as it stops)
    cluster.procs[survivor].terminate()
    cluster.procs[survivor].wait(30)
    with open(os.path.join(str(tmp_path), f"{survivor}-kv-trace.json")) as f:
        trace = json.load(f)
    assert sum(1 for _seq, what, _t in trace if what == "acked") > 0
    print(f"victim {victim} held {running}; failovers {failovers:g}, failed {len(failed)}; "
          f"streams ended {min(ended):.1f}-{max(ended):.1f}s after the cut")
