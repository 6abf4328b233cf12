"""Every TANDEM_* variable is read by something and documented; the workers' container health check."""

from __future__ import annotations

from tests.unit.deploy_files import *  # noqa: F403 (the shared readers and parsers)
from tests.unit.deploy_files import manifests  # noqa: F401 (a fixture)


def _source_text() -> str:
    """The code, and every setting's variable (read through tandem.cluster.settings' one rule)."""
    import dataclasses

    from tandem.cluster.settings import Settings, env_name

    variables = " ".join(env_name(f) for f in dataclasses.fields(Settings))
    return "\n".join(p.read_text() for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")) + "\n" + variables


def test_every_tandem_variable_is_read_by_something():
    sources, entrypoint = _source_text(), ENTRYPOINT.read_text()
    manifests_text = "\n".join(p.read_text() for p in KUBE.rglob("*.yaml"))
    names: set[str] = set()
    for svc in load_yaml(COMPOSE)["services"].values():
        names |= set((svc.get("environment") or {}))
    for doc in kube_docs(""):
        if doc["kind"] == "ConfigMap":
            names |= set(doc["data"])
    for _, _, container in tandem_containers(kube_docs("")):
        names |= {v["name"] for v in container.get("env", [])}
    for name in sorted(n for n in names if n.startswith("TANDEM_")):
        assert (name in sources or name in entrypoint or f"$({name})" in manifests_text), \
            f"{name} is set for the containers but nothing reads it"


def test_deploy_doc_names_every_variable_and_the_readme_points_at_it():
    doc = DEPLOY_DOC.read_text()
    variables = set()
    for path in (COMPOSE, COMPOSE_GPU):
        variables |= set(re.findall(r"\$\{(\w+)", path.read_text()))
    for d in kube_docs(""):
        if d["kind"] == "ConfigMap":
            variables |= set(d["data"])
    missing = sorted(v for v in variables if v not in doc)
    assert not missing, f"docs/deploy.md does not mention {missing}"
    readme = (ROOT / "README.md").read_text()
    for path in ("docs/deploy.md", "compose.gpu.yaml", "deploy/kubernetes/"):
        assert path in readme, f"README.md does not point at {path}"


# ---- the workers' health check ------------------------------------------------------------
@pytest.fixture
def redis_url():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from tandem.redis_server import RedisServer

    server = RedisServer()
    yield server.url
    server.stop()


def _register(url: str, role: str, worker_id: str, **fields) -> None:
    import redis

    from tandem.cluster import keys
    from tandem.cluster.messages import WorkerInfo, encode
    from tandem.cluster.process import pid_namespace

    info = dict(worker_id=worker_id, role=role, model="m", inbox="i", pid=os.getpid(), host=os.uname().nodename,
                started_at=1.0, heartbeat_at=1.0, num_total_blocks=1, num_free_blocks=1,
                pid_namespace=pid_namespace())
    info.update(fields)
    client = redis.Redis.from_url(url)
    client.set(keys.worker(role, worker_id), encode(WorkerInfo(**info)), px=60_000)
    client.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_healthcheck_finds_this_containers_worker(redis_url):
    check = healthcheck_module().check
    assert check("decode", redis_url)[0] == 1  # nothing registered
    _register(redis_url, "decode", "decode-elsewhere", host="another-host")
    _register(redis_url, "decode", "decode-gone", pid=_dead_pid())  # here, but its process is gone
    _register(redis_url, "prefill", "prefill-here")
    status, line = check("decode", redis_url)
    assert status == 1 and "no live registry record" in line
    assert check("prefill", redis_url) == (0, "prefill worker registered: prefill-here")
    _register(redis_url, "decode", "decode-here")
    assert check("decode", redis_url) == (0, "decode worker registered: decode-here")


def test_healthcheck_without_redis_fails_readiness_not_liveness():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there
    script = [sys.executable, str(HEALTHCHECK), "decode", "--redis-url", url]
    ready = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert ready.returncode == 1 and "redis does not answer" in ready.stderr
    alive = subprocess.run([*script, "--liveness"], capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0, alive.stderr
