"""A cluster on a password-protected Redis (redis-server --requirepass), plain and over TLS:
every service reaches it through redis://:password@host:port/0 (rediss://...?ssl_ca_certs=
for TLS), a request is served, and the password is on no service's command line (tandem
serve hands it over in TANDEM_REDIS_URL)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import redis

from tandem.cluster.settings import Settings
from tandem.launcher import free_port, service_argv, stop_all, wait_healthy

pytestmark = pytest.mark.slow

PASSWORD = "pw-7f3a9c1e5b"
AMBIENT_REDIS_URL = os.environ.get("TANDEM_REDIS_URL")  # as this process was started


@pytest.fixture(params=["redis", "rediss"])
def protected_redis(request, tmp_path):
    port = free_port()
    argv = ["redis-server", "--bind", "127.0.0.1", "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path)]
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    if request.param == "rediss":
        pytest.importorskip("cryptography")
        from tests.gateway.test_admin_auth import _self_signed

        cert, key = _self_signed(tmp_path)
        argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key,
                 "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
        url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    else:
        argv += ["--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield port, url, client
    proc.terminate()
    proc.wait(10)


def test_a_cluster_on_a_password_protected_redis(tiny_llama, tmp_path, protected_redis, monkeypatch):
    port, url, client = protected_redis
    # service_argv sets it in os.environ; setenv first so that monkeypatch records its state and
    # puts it back afterwards (a delenv of an absent variable records nothing, and the URL of this
    # test's stopped redis-server would be every later `tandem serve`'s --redis-url default)
    monkeypatch.setenv("TANDEM_REDIS_URL", "")
    monkeypatch.delenv("TANDEM_REDIS_URL")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url.replace(PASSWORD, "wrong")).set("tandem:probe", 1)  # the password is needed
    settings = Settings(model=tiny_llama, redis_url=url, port=free_port(), admin_port=free_port(),
                        heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0, max_seq_len=256).resolve()
    procs = []
    try:
        for role, worker_id in (("decode", "decode-0"), ("prefill", "prefill-0"), ("gateway", None)):
            argv = service_argv(role, settings, worker_id)
            assert not any(PASSWORD in arg for arg in argv)
            log = open(tmp_path / f"{role}.log", "ab")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=log))
        base = f"http://{settings.host}:{settings.port}"
        assert wait_healthy(f"{base}/health", procs, 180), [(tmp_path / f"{r}.log").read_text()[-2000:]
                                                           for r in ("decode", "prefill", "gateway")]
        for proc in procs:  # what ps shows
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                assert PASSWORD.encode() not in f.read()
        body = {"model": settings.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        assert client.keys("tandem:worker:decode:*") and client.keys("tandem:worker:prefill:*")
    finally:
        stop_all(procs)
    assert os.environ.get("TANDEM_REDIS_URL") == url  # how the children got it


def test_serve_refuses_a_wrong_password_at_once(tiny_llama, protected_redis):
    """`tandem serve` on that Redis with a wrong password: exit 1 before any worker starts, the
    reason (the server's) printed and no password, right or wrong."""
    port, url, _ = protected_redis
    if url.startswith("rediss"):
        pytest.skip("the password check is the same over TLS")
    env = {**os.environ, "TANDEM_REDIS_URL": url.replace(PASSWORD, "wrong-4e2b")}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", tiny_llama, "--port", str(free_port()),
                           "--admin-port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr
    assert f"cannot reach the Redis of TANDEM_REDIS_URL (redis://:***@127.0.0.1:{port}/0)" in done.stderr
    assert "password" in done.stderr.lower() and "wrong-4e2b" not in done.stderr and PASSWORD not in done.stderr
    assert "starting prefill" not in done.stderr
    assert time.monotonic() - started < 60


def test_a_wrong_password_is_not_retried(protected_redis):
    """The launcher's check waits for a Redis that does not answer yet, not for a password that
    will not get better: a wrong one is refused at once, the right one passes."""
    from tandem.launcher import _check_redis

    port, url, _ = protected_redis
    started = time.monotonic()
    problem = _check_redis(url.replace(PASSWORD, "wrong-4e2b"), wait_s=10.0)
    assert problem is not None and "password" in problem.lower() and "wrong-4e2b" not in problem
    assert time.monotonic() - started < 5
    assert _check_redis(url, wait_s=10.0) is None


def test_the_password_test_leaves_no_redis_url_behind():
    """Runs after the cluster test above in the same process (same file): the URL it handed the children
    is gone again."""
    assert os.environ.get("TANDEM_REDIS_URL") == AMBIENT_REDIS_URL
