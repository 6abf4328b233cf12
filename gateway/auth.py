"""API keys for the HTTP API (``--api-key``, repeatable, or TANDEM_API_KEY, comma-separated).

With keys configured, every /v1 request (and /tokenize, /detokenize) needs
``Authorization: Bearer <key>`` with one of them, else 401 in the OpenAI error shape
(``errors.Unauthorized``). /health and /version stay
open (load balancer probes carry no key); /metrics too unless ``--metrics-require-auth``.
Keys are compared in constant time, each of them every time, and never logged.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.cluster.settings import Settings
from tandem.gateway.errors import Unauthorized, error_response


def install_api_key_auth(app, settings: Settings) -> None:
    """Add the check to ``app`` when ``settings`` names keys (none: the API is open)."""
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=settings.api_keys,
                           protect_metrics=settings.metrics_require_auth)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str], protect_metrics: bool = False):
        self.app = app
        self._keys = [key.encode() for key in api_keys]
        self._protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._protected(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(Unauthorized("a valid API key is needed: Authorization: Bearer <key>"))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _protected(self, path: str) -> bool:
        return (path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
                or (self._protect_metrics and path == "/metrics"))

    def _authorized(self, scope: Scope) -> bool:
        values = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, key = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        key = key.strip()
        matched = False
        for expected in self._keys:  # all of them: how long it takes does not tell which one matched
            matched |= hmac.compare_digest(key, expected)
        return matched
