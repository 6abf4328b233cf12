"""The Kubernetes manifests agree with the CLI and each other, and with Kubernetes' schemas."""

from __future__ import annotations

from tests.unit.deploy_files import *  # noqa: F403 (the shared readers and parsers)
from tests.unit.deploy_files import manifests  # noqa: F401 (a fixture)


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
