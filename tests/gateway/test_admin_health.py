"""The admin port's standard gRPC services, through grpc's own clients: health (overall, the
admin API and each pool; NOT_SERVING while a pool has no live worker of the gateway's model
or the gateway drains) and server reflection (what grpcurl uses)."""

from __future__ import annotations

import threading

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.gateway.conftest import free_port, register_prefill, token_script, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "tandem.admin.v1.Admin", "prefill", "decode")


def _statuses(stub) -> dict[str, int]:
    return {name: stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status for name in SERVICES}


def test_health_follows_the_pools_of_the_gateways_model(admin_channel, fake_worker, rclient, text_ids):
    _server, channel = admin_channel()
    stub = health_pb2_grpc.HealthStub(channel)
    # no worker: the admin API answers (Redis does), nothing else serves
    assert wait_for(lambda: _statuses(stub) == {"": NOT_SERVING, "tandem.admin.v1.Admin": SERVING,
                                                "prefill": NOT_SERVING, "decode": NOT_SERVING})
    fake_worker(token_script(text_ids), worker_id="decode-other", model="another-model")
    register_prefill(rclient)
    assert wait_for(lambda: _statuses(stub)["prefill"] == SERVING)
    threading.Event().wait(1.5)  # more than one refresh: a worker of another model does not count
    assert _statuses(stub)["decode"] == NOT_SERVING and _statuses(stub)[""] == NOT_SERVING
    fake_worker(token_script(text_ids), worker_id="decode-a")
    assert wait_for(lambda: set(_statuses(stub).values()) == {SERVING})
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(health_pb2.HealthCheckRequest(service="router"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_sees_serving_then_draining(admin_channel, fake_worker, rclient, text_ids):
    server, channel = admin_channel()
    stub = health_pb2_grpc.HealthStub(channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
    assert next(watch).status == NOT_SERVING
    fake_worker(token_script(text_ids), worker_id="decode-a")
    register_prefill(rclient)
    assert next(watch).status == SERVING
    server.app.state.health.set_draining()  # from another thread, as the drain path may
    assert next(watch).status == NOT_SERVING
    watch.cancel()
    assert set(_statuses(stub).values()) == {NOT_SERVING}  # every service, for good
    threading.Event().wait(1.2)
    assert set(_statuses(stub).values()) == {NOT_SERVING}


def test_health_is_not_serving_while_redis_is_away(model_dir):
    from tandem.gateway.app import create_app
    from tests.gateway.conftest import ServerThread, make_settings

    port = free_port()
    app = create_app(make_settings(model_dir, "redis://127.0.0.1:1/0", admin_port=port))  # nothing listens there
    with ServerThread(app), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        threading.Event().wait(1.5)
        assert set(_statuses(stub).values()) == {NOT_SERVING}


def test_reflection_lists_the_services_and_describes_the_admin_api(admin_channel):
    _server, channel = admin_channel()
    database = ProtoReflectionDescriptorDatabase(channel)
    assert set(database.get_services()) == {"tandem.admin.v1.Admin", "grpc.health.v1.Health",
                                            "grpc.reflection.v1alpha.ServerReflection"}
    admin = DescriptorPool(database).FindServiceByName("tandem.admin.v1.Admin")
    assert {m.name for m in admin.methods} >= {"ListWorkers", "DrainWorker", "CancelRequest"}
