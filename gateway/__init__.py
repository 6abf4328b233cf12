"""OpenAI-compatible HTTP gateway: validation, tokenization, routing, SSE streaming, metrics.

Entry points: ``tandem.gateway.app.create_app(settings)`` (the FastAPI app) and
``tandem.gateway.server.main(settings)`` (run it under uvicorn). Torch-free.
"""
