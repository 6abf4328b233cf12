"""The HTTP app: OpenAI routes that only translate between HTTP and ``GatewayService``.

``create_app(settings)`` resolves the settings (model limits), loads the
tokenizer and returns the FastAPI app, whose lifespan also serves the gRPC admin
API (``tandem.gateway.admin``) on ``--admin-port``. Errors are mapped to responses in
``tandem.gateway.errors`` only; bodies over ``MAX_BODY_BYTES`` get a 413.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.cluster.settings import Settings
from tandem.gateway.auth import install_api_key_auth
from tandem.gateway.body_limit import BodyLimitMiddleware
from tandem.gateway.cancellation import GenerationStreamResponse, followed_stream_response, until_disconnected
from tandem.gateway.drain import DrainMiddleware
from tandem.gateway.errors import install_error_handlers
from tandem.gateway.health import GatewayHealth
from tandem.gateway.choices import Choices
from tandem.gateway.metrics import CONTENT_TYPE, StatusMiddleware
from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.protocol import CompletionRequest, SamplingFields
from tandem.gateway.responses import ResponseFormat, sse_events, with_ids
from tandem.gateway.service import GatewayService
from tandem.gateway import tools

MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(settings: Settings, *, tokenizer=None, redis=None) -> FastAPI:
    """The gateway app. ``tokenizer`` and ``redis`` (a redis.asyncio client) override the defaults in tests."""
    settings.resolve()
    service = GatewayService(settings, tokenizer=tokenizer, redis=redis)
    admin_health = GatewayHealth(service.router)  # the admin port's grpc.health.v1; set_draining() on the way down

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        service.mux.start()
        await service.prepare()
        admin = None
        if settings.admin_port:
            from tandem.gateway.admin import start_admin_server

            admin = await start_admin_server(service.redis, settings.admin_host, settings.admin_port, admin_health,
                                             token=settings.admin_token, tls_cert=settings.admin_tls_cert,
                                             tls_key=settings.admin_tls_key)
        yield
        admin_health.stop()
        if admin is not None:
            await admin.stop(grace=1.0)
        await service.close()

    app = FastAPI(title="tandem gateway", lifespan=lifespan)
    app.state.service = service
    app.state.health = admin_health
    service.drain.on_drain(admin_health.set_draining)  # gRPC health NOT_SERVING while draining
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=MAX_BODY_BYTES)
    app.add_middleware(DrainMiddleware, drain=service.drain)
    install_api_key_auth(app, settings)  # --api-key: before anything reads the body
    app.add_middleware(StatusMiddleware, metrics=service.metrics)  # outermost: counts the 413s too

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        inp = await service.prepare_completion(body)
        choices = await service.start(inp, prefix="cmpl", client_gone=request.is_disconnected)
        return await _respond(request, body, choices, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        inp = await service.prepare_chat(body)
        choices = await service.start(inp, prefix="chatcmpl", client_gone=request.is_disconnected)
        return await _respond(request, body, choices, chat=True)

    @app.get("/v1/streams/{request_id}")
    async def resume_stream(request_id: str, request: Request, last_event_id: str | None = None):
        # the header (what an EventSource sends when it reconnects) wins over the query
        events = await service.streams.open(request_id, request.headers.get("last-event-id") or last_event_id)
        return followed_stream_response(events, request_id)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/health")
    async def health():
        healthy, report = await service.health()
        return JSONResponse(report, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(await service.metrics_text(), media_type=CONTENT_TYPE)

    async def _respond(request: Request, body: SamplingFields, choices: Choices, chat: bool):
        fmt = ResponseFormat(choices.request_id, choices.created, settings.model_name, chat,
                             bool(body.return_token_ids), choices.generations[0].input.prompt_token_ids,
                             service.token_text)
        parser = choices.generations[0].input.tool_parser if chat else None
        if body.stream:
            if body.resumable:
                events = await service.streams.start(choices, fmt, body.include_usage, body.continuous_usage)
                return followed_stream_response(events, choices.request_id)
            deltas = choices.deltas()
            if parser is not None:
                deltas = tools.read_deltas(parser, deltas)
            events = sse_events(fmt, deltas, lambda: choices.usage, body.include_usage,
                                body.continuous_usage, choices.n)
            return GenerationStreamResponse(with_ids(choices.request_id, events), choices)
        try:
            results = await until_disconnected(request, choices.collect())
        finally:
            choices.close()
        if parser is not None:
            results = tools.read_results(parser, results)
        return JSONResponse(fmt.completion(results, choices.usage), headers={"X-Request-Id": choices.request_id})

    return app
