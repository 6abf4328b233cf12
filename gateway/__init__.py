"""OpenAI-compatible HTTP gateway: validation, tokenization, routing, SSE streaming, metrics.

Entry points: ``gateway.app.create_app(settings)`` (the FastAPI app) and
``gateway.server.main(settings)`` (run it under uvicorn). Torch-free.
"""
