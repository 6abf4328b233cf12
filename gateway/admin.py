"""The gRPC admin API (``gateway/admin.proto``), served by each gateway on ``--admin-port``.

Every method reads or writes the cluster's state in Redis, so any gateway answers
for the whole cluster: the registry (``ListWorkers``), the live policies the
workers re-read between steps (``tandem.cluster.live_policies``), the drain marks the routers
skip (``tandem.cluster.draining``), the decode workers' inboxes (``CancelRequest``
sends the same ``AbortRequest`` a client disconnect does) and the served LoRA adapters
(``LoadLoraAdapter``, ``UnloadLoraAdapter``, ``ListLoraAdapters``: ``tandem.gateway.lora_adapters``,
the same checks as the HTTP routes; FAILED_PRECONDITION without --enable-lora). Bad
arguments get INVALID_ARGUMENT or NOT_FOUND and change nothing; a Redis error is UNAVAILABLE.

The same port serves the standard health service (``tandem.gateway.health``) and
server reflection (so ``grpcurl`` needs no .proto). With a token (``--admin-token``)
every call but the health service's needs the metadata ``authorization: Bearer
<token>``, else UNAUTHENTICATED (probes carry no token); with a certificate and key
(``--admin-tls-cert``/``--admin-tls-key``) the port speaks TLS only.

The stubs are generated from the .proto when this module is imported
(``grpc.protos_and_services``, grpcio-tools): no generated code is checked in, so
they always match the installed protobuf runtime.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import socket
import sys
import time

import grpc
import redis.asyncio as aioredis
import structlog
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_reflection.v1alpha import reflection
from redis.exceptions import RedisError

from tandem.cluster import keys
from tandem.cluster.draining import is_drained, is_draining, mark_value, parse_marks
from tandem.cluster.messages import FIELD, AbortRequest, WorkerInfo, encode
from tandem.cluster.policies import CAPACITY_POLICY_NAMES, CHUNKING_POLICY_NAMES
from tandem.cluster.lora_registry import LoraRecord
from tandem.cluster.settings import Settings
from tandem.gateway.errors import AdapterNotFound, GatewayError, InvalidRequest, LoraNotEnabled
from tandem.gateway.health import GatewayHealth
from tandem.gateway.lora_adapters import LoraAdapters
from tandem.gateway.router import ROLES, live_workers

log = structlog.get_logger(__name__)

PROTO = "tandem/gateway/admin.proto"  # its import path: the stubs are tandem.gateway.admin_pb2(_grpc)


def _put_proto_on_path() -> None:
    """grpc finds the .proto through sys.path, as PROTO under one of its entries. An installed
    tandem has it there (site-packages); an editable install maps tandem.gateway onto the
    checkout's gateway/ folder through an import hook, so a directory holding only a copy of
    the file at PROTO goes at the end of sys.path. (Never the checkout root: its folders would
    be found as top-level packages, tandem.import_guard.)"""
    if any(isinstance(entry, str) and os.path.isfile(os.path.join(entry or ".", PROTO)) for entry in sys.path):
        return
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "admin.proto"), "rb") as f:
        data = f.read()
    cache = Settings.field_default("cache")
    root = os.path.join(cache, "protos", hashlib.sha256(data).hexdigest()[:16])
    target = os.path.join(root, PROTO)
    if not os.path.isfile(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)  # whole or not at all: services start side by side
    sys.path.append(root)


_put_proto_on_path()
pb, pb_grpc = grpc.protos_and_services(PROTO)

_CAPACITY = pb.CapacitySchedulerPolicy
_CHUNKING = pb.ContextChunkingPolicy
POLICY_FIELDS = {"capacity_scheduler_policy": (_CAPACITY, CAPACITY_POLICY_NAMES),
                 "context_chunking_policy": (_CHUNKING, CHUNKING_POLICY_NAMES)}
CANCEL_REASON = "cancelled through the admin API"
OPEN_METHODS = "/grpc.health.v1.Health/"  # no token needed: load balancer and Kubernetes probes


class AdminError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _rpc(method):
    """Map AdminError, the gateway's own errors and Redis errors to gRPC statuses; nothing else is caught."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request)
        except AdminError as exc:
            await context.abort(exc.code, str(exc))
        except GatewayError as exc:
            await context.abort(_status_of(exc), exc.message)
        except RedisError as exc:
            log.warning("admin call failed: redis", method=method.__name__, error=str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {exc}")

    return wrapper


def _status_of(exc: GatewayError) -> grpc.StatusCode:
    if isinstance(exc, LoraNotEnabled):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, AdapterNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def lora_message(record: LoraRecord):
    return pb.LoraAdapter(name=record.name, path=record.path, digest=record.digest, rank=record.rank,
                          created=record.created)


def worker_message(worker: WorkerInfo, draining: bool, drained: bool = False):
    return pb.Worker(
        worker_id=worker.worker_id, role=worker.role, model=worker.model, host=worker.host, pid=worker.pid,
        started_at=worker.started_at, heartbeat_at=worker.heartbeat_at, num_total_blocks=worker.num_total_blocks,
        num_free_blocks=worker.num_free_blocks, num_running=worker.num_running, num_waiting=worker.num_waiting,
        block_size=worker.block_size, max_seq_len=worker.max_seq_len, max_batch_size=worker.max_batch_size,
        capacity_scheduler_policy=worker.capacity_scheduler_policy, num_preemptions=worker.num_preemptions,
        device=worker.device, draining=draining, drained=drained, num_restarts=worker.num_restarts,
        host_tier_blocks=worker.host_tier_blocks, host_tier_capacity=worker.host_tier_capacity,
        host_tier_hits=worker.host_tier_hits, host_tier_evictions=worker.host_tier_evictions,
        host_tier_bytes_out=worker.host_tier_bytes_out, host_tier_bytes_in=worker.host_tier_bytes_in,
    )


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, client: aioredis.Redis, adapters: LoraAdapters | None = None):
        """``adapters``: the gateway's LoRA adapters (None: LoRA calls answer FAILED_PRECONDITION)."""
        self._client = client
        self._adapters = adapters

    @_rpc
    async def ListWorkers(self, request):
        roles = _roles(request.role)
        workers = []
        for role in roles:
            marks = parse_marks(await self._client.hgetall(keys.draining(role)))
            for w in sorted(await live_workers(self._client, role), key=lambda w: w.worker_id):
                draining = is_draining(w, marks)
                admitted = await self._client.hlen(keys.admitted(w.worker_id)) if draining and role == "decode" else 0
                workers.append(worker_message(w, draining, is_drained(w, marks, admitted)))
        return pb.ListWorkersResponse(workers=workers)

    @_rpc
    async def GetPolicies(self, request):
        return await self._policies()

    @_rpc
    async def SetPolicies(self, request):
        values = {}
        for name, (enum, allowed) in POLICY_FIELDS.items():
            number = getattr(request, name)
            if number == 0:
                continue  # UNSPECIFIED: unchanged
            label = enum.Name(number) if number in enum.values() else None
            if label not in allowed:
                raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} {number} names no policy")
            values[name] = label
        if not values:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             "set capacity_scheduler_policy or context_chunking_policy")
        await self._client.hset(keys.policy(), mapping=values)
        log.info("policies set through the admin API", **values)
        return await self._policies()

    @_rpc
    async def DrainWorker(self, request):
        worker = await self._find(request.worker_id, request.role)
        runs = {w.worker_id: w.started_at for w in await live_workers(self._client, worker.role)}
        marked = parse_marks(await self._client.hgetall(keys.draining(worker.role)))
        pipe = self._client.pipeline(transaction=True)
        # marks of runs a new run of the worker replaced (not of a worker whose key lapsed: it may be back)
        replaced = [w for w, mark in marked.items() if w in runs and runs[w] != mark.started_at]
        if replaced:
            pipe.hdel(keys.draining(worker.role), *replaced)
        pipe.hset(keys.draining(worker.role), worker.worker_id, mark_value(worker, time.time()))
        await pipe.execute()
        log.info("worker draining", role=worker.role, worker_id=worker.worker_id)
        return worker_message(worker, True)

    @_rpc
    async def UndrainWorker(self, request):
        worker = await self._find(request.worker_id, request.role)
        await self._client.hdel(keys.draining(worker.role), worker.worker_id)
        log.info("worker undrained", role=worker.role, worker_id=worker.worker_id)
        return worker_message(worker, False)

    @_rpc
    async def CancelRequest(self, request):
        request_id = request.request_id
        if not request_id:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        # the workers hold it under its id, or each of its n choices under "<id>-<i>" (gateway.choices),
        # either with ".<n>" after n failovers (gateway.generation)
        wire = re.compile(re.escape(request_id) + r"(-\d+)?(\.\d+)?")
        pattern = _glob_escape(request_id) + "*"
        cancelled = []  # (worker id, wire id)
        for worker in await live_workers(self._client, "decode"):
            async for field, _tokens in self._client.hscan_iter(keys.admitted(worker.worker_id), match=pattern):
                wire_id = field.decode() if isinstance(field, bytes) else field
                if wire.fullmatch(wire_id):
                    await self._client.xadd(keys.inbox("decode", worker.worker_id),
                                            {FIELD: encode(AbortRequest(wire_id, CANCEL_REASON))})
                    log.info("request cancelled through the admin API", request_id=wire_id,
                             worker_id=worker.worker_id)
                    cancelled.append((worker.worker_id, wire_id))
        if not cancelled:
            raise AdminError(grpc.StatusCode.NOT_FOUND, f"no decode worker holds request {request_id!r}")
        return pb.CancelRequestResponse(worker_id=cancelled[0][0], request_ids=sorted(w for _, w in cancelled))

    @_rpc
    async def LoadLoraAdapter(self, request):
        record, added = await self._lora().load(request.name, request.path)
        return pb.LoadLoraAdapterResponse(adapter=lora_message(record), already_loaded=not added)

    @_rpc
    async def UnloadLoraAdapter(self, request):
        return lora_message(await self._lora().unload(request.name))

    @_rpc
    async def ListLoraAdapters(self, request):
        adapters = self._lora()
        return pb.ListLoraAdaptersResponse(base_model=adapters.base_model,
                                           adapters=[lora_message(r) for r in await adapters.list()])

    def _lora(self) -> LoraAdapters:
        if self._adapters is None:
            raise LoraNotEnabled("this admin API serves no LoRA adapters")
        self._adapters.check_enabled()
        return self._adapters

    async def _policies(self):
        live = await self._client.hgetall(keys.policy())
        values = {}
        for name, (enum, allowed) in POLICY_FIELDS.items():
            raw = live.get(name.encode())
            label = raw.decode() if raw is not None else ""
            values[name] = enum.Value(label) if label in allowed else 0  # absent or unknown: UNSPECIFIED
        return pb.Policies(**values)

    async def _find(self, worker_id: str, role: str) -> WorkerInfo:
        if not worker_id:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, "worker_id is empty")
        found = [w for r in _roles(role) for w in await live_workers(self._client, r) if w.worker_id == worker_id]
        if not found:
            raise AdminError(grpc.StatusCode.NOT_FOUND, f"no live worker {worker_id!r}" + (f" in the {role} pool" if role else ""))
        if len(found) > 1:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"a prefill and a decode worker are both named {worker_id!r}: give role")
        return found[0]


class TokenAuth(grpc.aio.ServerInterceptor):
    """Every call outside ``OPEN_METHODS`` needs ``authorization: Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS) or self._authorized(details.invocation_metadata):
            return handler
        return _refusal(handler, details.method)

    def _authorized(self, metadata) -> bool:
        values = [value for key, value in metadata or () if key == "authorization"]
        if len(values) != 1:
            return False
        value = values[0].encode() if isinstance(values[0], str) else values[0]
        return hmac.compare_digest(value, self._expected)  # constant time: no guessing byte by byte


def _refusal(handler, method: str):
    """A handler of the same kind as ``handler`` that only answers UNAUTHENTICATED."""

    async def refuse(_request, context):
        log.warning("admin call refused: no valid token", method=method, peer=context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this admin API needs 'authorization: Bearer <token>'")

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _roles(role: str) -> tuple[str, ...]:
    if role and role not in ROLES:
        raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, f"role must be one of {ROLES} or empty, not {role!r}")
    return (role,) if role else ROLES


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


async def start_admin_server(client: aioredis.Redis, host: str, port: int, health: GatewayHealth | None = None, *,
                             adapters: LoraAdapters | None = None, token: str | None = None,
                             tls_cert: str | None = None, tls_key: str | None = None) -> grpc.aio.Server:
    """Serve the admin API, ``health``'s service and reflection on host:port (in the running
    event loop); ``adapters``: the gateway's LoRA adapters; ``token``: calls but health need it;
    ``tls_cert``/``tls_key`` (PEM files): TLS only. Raises OSError if it cannot bind or read the files."""
    credentials = None
    if tls_cert is not None and tls_key is not None:
        with open(tls_key, "rb") as key, open(tls_cert, "rb") as cert:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
    server = grpc.aio.server(interceptors=[TokenAuth(token)] if token else None,
                             options=[("grpc.so_reuseport", 0)])  # a port in use is an error, not shared
    pb_grpc.add_AdminServicer_to_server(AdminServicer(client, adapters), server)
    services = [pb.DESCRIPTOR.services_by_name["Admin"].full_name, reflection.SERVICE_NAME]
    if health is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
        services.append(HEALTH_SERVICE)
    reflection.enable_server_reflection(services, server)
    # every address the host resolves to, one by one: grpc binds a name to whichever of its
    # addresses it can and succeeds if one works (localhost: ::1 bound, 127.0.0.1 someone else's)
    addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
    for address in addresses:
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        try:
            if credentials is None:
                server.add_insecure_port(target)
            else:
                server.add_secure_port(target, credentials)
        except RuntimeError as exc:  # grpc's "Failed to bind"
            raise OSError(f"the admin API cannot listen on {target} ({host}:{port}): {exc}") from exc
    if health is not None:
        await health.start()
    await server.start()
    log.info("admin API listening", host=host, port=port, tls=credentials is not None, token=bool(token))
    return server
