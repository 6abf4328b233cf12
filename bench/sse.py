"""Server-sent events from an OpenAI-compatible stream: the SSE line decoder, the
JSON payloads of one event, and the generated text or error message a chunk
carries. Used by :mod:`tandem.bench.serve_request`; torch-free, stdlib only.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

DONE = "[DONE]"


class SSEDecoder:
    """Incremental ``text/event-stream`` decoder: feed it lines (without their line
    ending), get back the ``data`` payload of each completed event.

    Comment lines (``:...``) and other fields (``event:``, ``id:``, ``retry:``) are
    ignored; consecutive ``data:`` lines of one event are joined with ``\\n`` as the
    spec says, and a blank line ends the event. Call :meth:`flush` at the end of the
    stream for an event that was not followed by a blank line.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> list[str]:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return []
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return []

    def flush(self) -> list[str]:
        if not self._data:
            return []
        data = "\n".join(self._data)
        self._data = []
        return [data]


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` payloads of an SSE stream given as lines (ends at ``[DONE]``,
    which is yielded too)."""
    decoder = SSEDecoder()
    for line in lines:
        for data in decoder.feed(line):
            yield data
            if data.strip() == DONE:
                return
    yield from decoder.flush()


def decode_payload(data: str) -> list[Any]:
    """JSON objects of one event's data. A server that forgot the blank line between
    events makes several ``data:`` lines join into one event; split them back."""
    data = data.strip()
    if not data:
        return []
    try:
        return [json.loads(data)]
    except json.JSONDecodeError:
        if "\n" not in data:
            raise
        out: list[Any] = []
        for part in data.split("\n"):
            part = part.strip()
            if part and part != DONE:
                out.append(json.loads(part))
        return out


def error_message(obj: Any) -> str | None:
    """The message of an OpenAI-style error object (``{"error": {...}}``,
    ``{"object": "error", "message": ...}``, FastAPI's ``{"detail": ...}``), or
    ``None`` when ``obj`` is not an error."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if err:
        if isinstance(err, dict):
            return str(err.get("message") or err.get("type") or json.dumps(err))
        return str(err)
    if obj.get("object") == "error":
        return str(obj.get("message") or json.dumps(obj))
    if "detail" in obj and "choices" not in obj:
        detail = obj["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)
    return None


def chunk_content(obj: dict, chat: bool) -> str:
    """The generated text in one streamed chunk (all choices concatenated)."""
    parts: list[str] = []
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if chat:
            delta = choice.get("delta") or {}
            for key in ("content", "reasoning_content", "reasoning"):
                value = delta.get(key)
                if isinstance(value, str) and value:
                    parts.append(value)
        else:
            value = choice.get("text")
            if isinstance(value, str) and value:
                parts.append(value)
    return "".join(parts)


def http_error_text(status: int, body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        msg = error_message(json.loads(text)) if text else None
    except json.JSONDecodeError:
        msg = None
    msg = msg or text[:500] or "(empty body)"
    return f"HTTP {status}: {msg}"
