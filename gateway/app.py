"""The HTTP app: OpenAI routes that only translate between HTTP and ``GatewayService``.

``create_app(settings)`` resolves the settings (model limits), loads the
tokenizer and returns the FastAPI app, whose lifespan also serves the gRPC admin
API (``tandem.gateway.admin``) on ``--admin-port``. Errors are mapped to responses in
``tandem.gateway.errors`` only; bodies over ``MAX_BODY_BYTES`` get a 413.

With --enable-lora, vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
change the served LoRA adapters (``tandem.gateway.lora_adapters``; a plain-text "Success: ..."
as vLLM answers), a request's ``model`` may name one, and ``GET /v1/models`` lists them. A
``--lora-modules`` adapter that cannot be served stops the gateway at startup
(``app.state.startup_error`` says why).
"""

from __future__ import annotations

import importlib.metadata
from contextlib import asynccontextmanager

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tandem.cluster.settings import Settings
from tandem.gateway.auth import install_api_key_auth
from tandem.gateway.body_limit import BodyLimitMiddleware
from tandem.gateway.cancellation import (GenerationStreamResponse, followed_stream_response, until_disconnected,
                                         watching_disconnect)
from tandem.gateway.drain import DrainMiddleware
from tandem.gateway.errors import InvalidRequest, install_error_handlers
from tandem.gateway.lora_protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, loaded_text, unloaded_text
from tandem.gateway.health import GatewayHealth
from tandem.gateway.choices import Choices
from tandem.gateway.metrics import CONTENT_TYPE, StatusMiddleware
from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.openai_responses import ResponseShape, ResponsesRequest, as_responses_error
from tandem.gateway.protocol import CompletionRequest, SamplingFields
from tandem.gateway.responses import ResponseFormat, sse_events, with_ids
from tandem.gateway.service import GatewayService
from tandem.gateway.tokenize_protocol import DetokenizeRequest, parse_tokenize
from tandem.gateway import tools

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(settings: Settings, *, tokenizer=None, redis=None) -> FastAPI:
    """The gateway app. ``tokenizer`` and ``redis`` (a redis.asyncio client) override the defaults in tests."""
    settings.resolve()
    service = GatewayService(settings, tokenizer=tokenizer, redis=redis)
    admin_health = GatewayHealth(service.router)  # the admin port's grpc.health.v1; set_draining() on the way down

    @asynccontextmanager
    async def lifespan(served: FastAPI):
        service.mux.start()
        try:
            await service.prepare()
        except Exception as exc:  # a --lora-modules adapter that cannot be served: the gateway stops
            served.state.startup_error = getattr(exc, "message", None) or str(exc)
            log.error("the gateway cannot start", error=served.state.startup_error)
            await service.close()
            raise
        admin = None
        if settings.admin_port:
            from tandem.gateway.admin import start_admin_server

            admin = await start_admin_server(service.redis, settings.admin_host, settings.admin_port, admin_health,
                                             adapters=service.adapters, token=settings.admin_token,
                                             tls_cert=settings.admin_tls_cert, tls_key=settings.admin_tls_key)
        yield
        admin_health.stop()
        if admin is not None:
            await admin.stop(grace=1.0)
        await service.close()

    app = FastAPI(title="tandem gateway", lifespan=lifespan)
    app.state.service = service
    app.state.startup_error = None
    app.state.health = admin_health
    service.drain.on_drain(admin_health.set_draining)  # gRPC health NOT_SERVING while draining
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=MAX_BODY_BYTES)
    app.add_middleware(DrainMiddleware, drain=service.drain)
    install_api_key_auth(app, settings)  # --api-key: before anything reads the body
    app.add_middleware(StatusMiddleware, metrics=service.metrics)  # outermost: counts the 413s too

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        inputs = await service.prepare_completion(body)  # one per prompt
        async with watching_disconnect(request) as client_left:
            choices = await service.start(inputs, prefix="cmpl", client_left=client_left)
        return await _respond(request, body, choices, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        inputs = await service.prepare_chat(body)
        async with watching_disconnect(request) as client_left:
            choices = await service.start(inputs, prefix="chatcmpl", client_left=client_left)
        return await _respond(request, body, choices, chat=True)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        try:
            inputs = await service.prepare_chat(body.as_chat())
        except InvalidRequest as exc:
            raise as_responses_error(exc) from exc
        async with watching_disconnect(request) as client_left:
            choices = await service.start(inputs, prefix="resp", client_left=client_left)
        model = choices.generations[0].input.lora_name or settings.model_name
        shape = ResponseShape(body, choices.request_id, model, choices.created)
        if body.stream:
            return GenerationStreamResponse(shape.events(choices.deltas(), lambda: choices.usage), choices)
        try:
            results = await until_disconnected(request, choices.collect())
        finally:
            choices.close()
        answer = results[0]
        return JSONResponse(shape.complete(answer.text, answer.finish_reason, choices.usage),
                            headers={"X-Request-Id": choices.request_id})

    @app.get("/v1/streams/{request_id}")
    async def resume_stream(request_id: str, request: Request, last_event_id: str | None = None):
        # the header (what an EventSource sends when it reconnects) wins over the query
        events = await service.streams.open(request_id, request.headers.get("last-event-id") or last_event_id)
        return followed_stream_response(events, request_id)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": await service.model_cards()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        return await service.model_card_of(model)

    @app.post("/tokenize")
    async def tokenize(request: Request):  # two forms, told apart by their fields (tokenize_protocol)
        return await service.tokenize(parse_tokenize(await request.body()))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await service.detokenize(body)

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("tandem")}  # the installed release's

    def lora_enabled() -> None:  # a dependency: runs before the body is read, so it answers first
        service.adapters.check_enabled()

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(lora_enabled)], response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        await service.adapters.load(body.lora_name, body.lora_path)
        return PlainTextResponse(loaded_text(body.lora_name))

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(lora_enabled)], response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        await service.adapters.unload(body.lora_name)
        return PlainTextResponse(unloaded_text(body.lora_name))

    @app.get("/health")
    async def health():
        healthy, report = await service.health()
        return JSONResponse(report, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(await service.metrics_text(), media_type=CONTENT_TYPE)

    async def _respond(request: Request, body: SamplingFields, choices: Choices, chat: bool):
        model = choices.generations[0].input.lora_name or settings.model_name  # an adapter answers as itself
        fmt = ResponseFormat(choices.request_id, choices.created, model, chat, bool(body.return_token_ids),
                             [g.input.prompt_token_ids for g in choices.generations[::choices.per_prompt]],
                             service.token_text, choices_per_prompt=choices.n // choices.num_prompts)
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
