"""Fixtures for gateway tests: a tiny local tokenizer, a private redis-server,
a gateway served by uvicorn in a thread, and a fake decode worker that speaks
the real protocol (registry record, inbox consumer group, TokenEvents)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
import redis
import uvicorn

from tandem.cluster import keys
from tandem.cluster.admission import Reservations
from tandem.cluster.inbox import Inbox
from tandem.cluster.messages import AbortRequest, GenerateRequest, TokenEvent, WorkerInfo, encode
from tandem.cluster.outputs import queue_events
from tandem.cluster.settings import Settings

MAX_POSITIONS = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tokenizer():
    """The byte-level BPE + chat template the rest of the project tests with."""
    from tandem.engine.demo_model import make_tiny_tokenizer  # imports torch, in the test process only

    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-model")
    build_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": MAX_POSITIONS,
                                                   "vocab_size": 512, "eos_token_id": 2}))
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from tandem.cluster.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server):
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    yield redis_server
    client.flushdb()


@pytest.fixture
def rclient(redis_url):
    return redis.Redis.from_url(redis_url)


def make_settings(model_dir: str, redis_url: str, **overrides) -> Settings:
    overrides.setdefault("admin_port", 0)  # no admin API unless a test asks for one (on a free port)
    # the fake workers heartbeat fast (TTL 0.5-1 s) and a lost one's request fails soon
    overrides.setdefault("heartbeat_interval_s", 0.1)
    overrides.setdefault("heartbeat_ttl_s", 0.5)
    overrides.setdefault("failover_wait_s", 1.0)
    settings = Settings(model=model_dir, served_model_name="tiny", redis_url=redis_url, **overrides)
    return settings.resolve()


class ServerThread:
    """A uvicorn server running ``app`` in a background thread."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


TEXT = "Hello world! How are you today?"


@pytest.fixture
def text_ids(tokenizer):
    return tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture
def serve(model_dir, redis_url):
    """serve(**settings_overrides) -> ServerThread (stopped at teardown)."""
    from tandem.gateway.app import create_app

    servers = []

    def start(**overrides) -> ServerThread:
        app = create_app(make_settings(model_dir, redis_url, **overrides))
        server = ServerThread(app).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


# a script maps a GenerateRequest to the events to write: (delay_s, TokenEvent) pairs
Script = Callable[[GenerateRequest], list[tuple[float, TokenEvent]]]


def token_script(token_ids: list[int], finish_reason: str = "length", delay_s: float = 0.0,
                 cached: int = 0) -> Script:
    """Prefill writes token 0, decode one event per later token; the last carries ``finish_reason``."""

    def script(req: GenerateRequest):
        events = []
        for i, token_id in enumerate(token_ids):
            last = i == len(token_ids) - 1
            events.append((delay_s, TokenEvent(req.request_id, i, [token_id], finish_reason if last else None,
                                               num_cached_tokens=cached if i == 0 else 0)))
        return events

    return script


@dataclass
class FakeDecodeWorker:
    """Registers like a decode worker, takes GenerateRequests from its inbox, plays ``script``."""

    redis_url: str
    script: Script
    worker_id: str = "decode-fake-0"
    num_free_blocks: int = 64
    num_total_blocks: int = 64
    block_size: int = 16
    num_running: int = 0
    ttl_s: float = 1.0
    started_at: float = 0.0
    model: str = "tiny"
    requests: list[GenerateRequest] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)
    # the fake plays the prefill pool's part too (it writes token 0 itself): it registers a
    # prefill worker beside itself, as the gateway admits nothing while no prefill worker lives
    with_prefill: bool = True
    beating: bool = True  # False: heartbeats pause while the worker goes on (a Redis wipe's view)

    def __post_init__(self):
        # one thread per request writes events: wait for a pooled connection instead of failing
        pool = redis.BlockingConnectionPool.from_url(self.redis_url, max_connections=256, timeout=30)
        self.client = redis.Redis(connection_pool=pool)
        self.inbox = Inbox(self.client, keys.inbox("decode", self.worker_id), self.worker_id)
        self.reservations = Reservations(self.client, self.worker_id)  # given back as a real worker does
        self._stop = threading.Event()
        self._alive = True
        self._threads = [threading.Thread(target=self._serve, daemon=True),
                         threading.Thread(target=self._beat, daemon=True)]

    def info(self, role: str = "decode") -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id, role=role, model=self.model, inbox=self.inbox.stream, pid=0, host="test",
            started_at=self.started_at, heartbeat_at=time.time(), num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_running=self.num_running, block_size=self.block_size, max_seq_len=MAX_POSITIONS,
        )

    def beat(self) -> None:
        if self._alive and self.beating:
            self.client.set(keys.worker("decode", self.worker_id), encode(self.info()), px=int(self.ttl_s * 1000))
            if self.with_prefill:
                register_prefill(self.client, "prefill-fake", ttl_s=max(self.ttl_s, 30.0), model=self.model)

    def start(self) -> "FakeDecodeWorker":
        self.beat()
        for thread in self._threads:
            thread.start()
        return self

    def die(self) -> None:
        """kill -9: stop heartbeating and answering (the key is left to expire)."""
        self._alive = False

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.client.delete(keys.worker("decode", self.worker_id))

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.beat()
            except redis.RedisError:
                pass  # Redis away: like a real worker, keep trying

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                messages = self.inbox.read(block_ms=50)
            except redis.RedisError:  # Redis restarted: the group is gone with the data
                time.sleep(0.05)
                try:
                    self.inbox.ensure_group()
                except redis.RedisError:
                    pass
                continue
            for msg in messages:
                if isinstance(msg, AbortRequest):
                    self.aborts.append(msg)
                    self._release(msg.request_id)
                elif isinstance(msg, GenerateRequest):
                    self.requests.append(msg)
                    threading.Thread(target=self._play, args=(msg,), daemon=True).start()

    def _play(self, req: GenerateRequest) -> None:
        for delay_s, event in self.script(req):
            if delay_s:
                time.sleep(delay_s)
            if not self._alive or self._stop.is_set():
                return
            if any(a.request_id == req.request_id for a in self.aborts):
                return
            pipe = self.client.pipeline(transaction=False)
            queue_events(pipe, [(req.reply_to, event)])  # exactly as the real workers publish
            pipe.execute()
        self._release(req.request_id)

    def _release(self, request_id: str) -> None:
        try:
            self.reservations.release([request_id])
        except redis.RedisError:
            pass  # Redis restarted: the reservations went with it


def register_prefill(client: redis.Redis, worker_id: str = "prefill-fake-0", ttl_s: float = 30.0,
                     model: str = "tiny") -> None:
    info = WorkerInfo(worker_id=worker_id, role="prefill", model=model, inbox=keys.inbox("prefill", worker_id),
                      pid=0, host="test", started_at=0.0, heartbeat_at=time.time(), num_total_blocks=64,
                      num_free_blocks=64)
    client.set(keys.worker("prefill", worker_id), encode(info), px=int(ttl_s * 1000))


@pytest.fixture
def fake_worker(redis_url):
    """fake_worker(script, **fields) -> a started FakeDecodeWorker (stopped at teardown)."""
    workers = []

    def start(script: Script, **fields) -> FakeDecodeWorker:
        worker = FakeDecodeWorker(redis_url, script, **fields).start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=kwargs.pop("timeout", 20), **kwargs)


def parse_sse(body: str) -> list:
    """The ``data:`` payloads of an SSE body: dicts, and the string "[DONE]" (every event's ``id:``
    line left out)."""
    out = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        block = "\n".join(line for line in block.split("\n") if not line.startswith("id: "))
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_for(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


@pytest.fixture
def admin_channel(serve):
    """admin_channel(**settings) -> (gateway server, channel to its admin port)."""
    channels = []

    def start(**overrides):
        port = free_port()
        server = serve(admin_port=port, **overrides)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return server, channel

    yield start
    for channel in channels:
        channel.close()
