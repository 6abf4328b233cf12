"""A tiny in-process SSE server with known delays for the ``tandem bench serve`` tests
(test_serve.py, test_serve_accounting.py). Its model name picks a behaviour: ``reject``,
``slow``, ``bad-chunk``, ``two-per-chunk``, ``stop-early``, ``midstream-error``,
``late-usage``, ``empty-text``; anything else streams one token a chunk."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.bench import serve

TTFT_S = 0.060  # server delay before the first token
ITL_S = 0.015  # server delay between tokens
CHAT_TEMPLATE_TOKENS = 5


def _make_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        model = body.get("model")
        if model == "reject":
            return JSONResponse(
                {"error": {"message": "model 'reject' does not exist", "type": "NotFound"}},
                status_code=404)
        n = int(body["max_tokens"])
        if chat:
            prompt_tokens = len(body["messages"][0]["content"].split()) + CHAT_TEMPLATE_TOKENS
        else:
            prompt_tokens = len(body["prompt"])

        def chunk(text: str, finish=None) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return f"data: {json.dumps({'object': 'chunk', 'choices': [choice]})}\n\n"

        async def gen():
            state["active"] += 1
            state["peak"] = max(state["peak"], state["active"])
            try:
                yield ": keep-alive\n\n"
                if chat:  # role-only first delta: no content, must not count as TTFT
                    yield ('data: {"choices": [{"index": 0, "delta": {"role": "assistant",'
                           ' "content": ""}}]}\n\n')
                await asyncio.sleep(5.0 if model == "slow" else TTFT_S)
                if model == "bad-chunk":  # a well-formed event with an ill-typed delta
                    yield 'data: {"choices": [{"index": 0, "delta": "BAD"}]}\n\n'
                    return
                if model == "empty-text":  # every token's text empty: only the finishing chunk is sent
                    yield chunk("", "length")
                per_chunk = 2 if model in ("two-per-chunk", "stop-early") else 1
                finish = "stop" if model == "stop-early" else "length"
                chunks = 0 if model == "empty-text" else n // per_chunk - (1 if model == "stop-early" else 0)
                for i in range(chunks):
                    if i:
                        await asyncio.sleep(ITL_S)
                    yield chunk(" t" * per_chunk, finish if i == chunks - 1 else None)
                    if model == "midstream-error":
                        yield 'data: {"error": {"message": "worker died", "code": 500}}\n\n'
                        return
                if model == "late-usage":
                    await asyncio.sleep(0.3)
                if body.get("stream_options", {}).get("include_usage") and not state["no_usage"]:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                             "total_tokens": prompt_tokens + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["active"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def sse_server():
    import uvicorn

    state: dict = {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(state), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 15
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("test SSE server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def server(sse_server):
    url, state = sse_server
    state.update(bodies=[], active=0, peak=0, no_usage=False)
    return url, state


def run_serve(argv: list[str]) -> int:
    """``tandem bench serve`` with ``argv`` (no progress bar) -> its exit code."""
    parser = serve.build_parser()
    return serve.main(parser.parse_args(argv + ["--no-progress"]))
