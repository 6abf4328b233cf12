"""The admin port's token and TLS: every Admin call (and reflection) needs the bearer token,
the health service stays open; with a certificate the port speaks TLS only; ``tandem admin``
sends the token and checks the certificate."""

from __future__ import annotations

import datetime
import ipaddress
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tandem.gateway.admin import pb, pb_grpc
from tests.gateway.conftest import free_port

TOKEN = "s3cret-admin-token"


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _bearer(token: str):
    return [("authorization", f"Bearer {token}")]


def _printed_json(capsys):
    """The JSON ``tandem admin`` printed (the gateway in this process may log lines before it)."""
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n"):])


def _cli(argv: list[str]) -> int:
    from tandem.cli import build_parser
    from tandem.gateway import admin_client

    return admin_client.main(build_parser().parse_args(argv))


def test_admin_calls_need_the_token_and_health_stays_open(serve, monkeypatch, capsys):
    port = free_port()
    serve(admin_port=port, admin_token=TOKEN)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.AdminStub(channel)
        request = pb.ListWorkersRequest()
        assert _code(lambda: stub.ListWorkers(request, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        for wrong in ("wrong", TOKEN + "x", TOKEN[:-1], ""):
            assert _code(lambda: stub.ListWorkers(request, timeout=5, metadata=_bearer(wrong))) == (
                grpc.StatusCode.UNAUTHENTICATED)
        assert _code(lambda: stub.ListWorkers(request, timeout=5, metadata=[("authorization", TOKEN)])) == (
            grpc.StatusCode.UNAUTHENTICATED)  # the scheme is part of it
        assert _code(lambda: stub.SetPolicies(pb.SetPoliciesRequest(capacity_scheduler_policy=pb.MAX_UTILIZATION),
                                              timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        assert list(stub.ListWorkers(request, timeout=5, metadata=_bearer(TOKEN)).workers) == []
        health = health_pb2_grpc.HealthStub(channel)  # probes carry no token
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status in (
            health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError):  # reflection is not open: no listing without the token
            ProtoReflectionDescriptorDatabase(channel).get_services()

    address = f"127.0.0.1:{port}"
    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    assert _cli(["admin", "--address", address, "workers"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert _cli(["admin", "--address", address, "--token", TOKEN, "workers"]) == 0
    assert _printed_json(capsys) == {"workers": []}
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", TOKEN)  # read when the parser is built
    assert _cli(["admin", "--address", address, "policies"]) == 0


def test_no_token_configured_leaves_the_admin_api_open(serve):
    port = free_port()
    serve(admin_port=port)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert list(pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers) == []


def _self_signed(directory) -> tuple[str, str]:
    """(certificate, key) PEM paths for localhost and 127.0.0.1, its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "admin.crt", directory / "admin.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_admin_port(serve, tmp_path, capsys):
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    port = free_port()
    serve(admin_port=port, admin_tls_cert=cert, admin_tls_key=key, admin_token=TOKEN)
    address = f"127.0.0.1:{port}"
    with open(cert, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(address, credentials) as channel:
        stub = pb_grpc.AdminStub(channel)
        assert list(stub.ListWorkers(pb.ListWorkersRequest(), timeout=5, metadata=_bearer(TOKEN)).workers) == []
        assert _code(lambda: stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as channel:  # plaintext is not spoken there
        assert _code(lambda: pb_grpc.AdminStub(channel).ListWorkers(
            pb.ListWorkersRequest(), timeout=5, metadata=_bearer(TOKEN))) == grpc.StatusCode.UNAVAILABLE
    (tmp_path / "other").mkdir()
    other_cert, _other_key = _self_signed(tmp_path / "other")
    with open(other_cert, "rb") as f, grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=f.read())) as channel:  # not the CA that signed it
        assert _code(lambda: pb_grpc.AdminStub(channel).ListWorkers(
            pb.ListWorkersRequest(), timeout=5, metadata=_bearer(TOKEN))) == grpc.StatusCode.UNAVAILABLE
    assert _cli(["admin", "--address", address, "--tls-ca", cert, "--token", TOKEN, "workers"]) == 0
    assert _printed_json(capsys) == {"workers": []}
    assert _cli(["admin", "--address", address, "--tls-ca", str(tmp_path / "missing.pem"), "workers"]) == 1


def test_tls_flags_are_checked(model_dir, tmp_path):
    from tandem.cluster.settings import Settings, SettingsError

    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(SettingsError, match="go together"):
        Settings(model=model_dir, admin_tls_cert=str(cert)).resolve()
    with pytest.raises(SettingsError, match="no file"):
        Settings(model=model_dir, admin_tls_cert=str(cert), admin_tls_key=str(tmp_path / "none")).resolve()
    with pytest.raises(SettingsError, match="admin-token"):
        Settings(model=model_dir, admin_token="").resolve()
