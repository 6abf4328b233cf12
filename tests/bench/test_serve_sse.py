"""Tests for SSE parsing and chunk/error extraction of ``tandem bench serve``
(bench/sse.py)."""

from __future__ import annotations

import json

import pytest

from tandem.bench import sse
from tandem.bench.sse import SSEDecoder, decode_payload, iter_sse_data


def test_sse_data_lines_blank_lines_comments_and_done():
    lines = [
        ": keep-alive comment",
        "",
        'data: {"a": 1}',
        "",
        "event: message",
        "id: 7",
        'data:{"a": 2}',  # no space after the colon is valid too
        "",
        "",
        "data: [DONE]",
        "",
        'data: {"a": 3}',  # after [DONE]: ignored
        "",
    ]
    assert list(iter_sse_data(lines)) == ['{"a": 1}', '{"a": 2}', "[DONE]"]


def test_sse_multiline_and_unterminated_events():
    d = SSEDecoder()
    assert d.feed('data: {"x":') == []
    assert d.feed("data: 1}") == []
    assert d.feed("\r\n") == ['{"x":\n1}']
    assert decode_payload('{"x":\n1}') == [{"x": 1}]
    # no blank line at the end of the stream: flushed
    assert list(iter_sse_data(['data: {"b": 1}'])) == ['{"b": 1}']
    # a server that forgot the blank lines between events
    joined = list(iter_sse_data(['data: {"c": 1}', 'data: {"c": 2}']))
    assert len(joined) == 1 and decode_payload(joined[0]) == [{"c": 1}, {"c": 2}]
    with pytest.raises(json.JSONDecodeError):
        decode_payload("{not json")
    assert decode_payload("   ") == []


def test_chunk_content_and_errors():
    comp = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
    chat = {"choices": [{"index": 0, "delta": {"content": "yo"}}]}
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    assert sse.chunk_content(comp, chat=False) == "hi"
    assert sse.chunk_content(chat, chat=True) == "yo"
    assert sse.chunk_content(role, chat=True) == ""
    assert sse.chunk_content(usage, chat=False) == ""
    assert sse.error_message(comp) is None
    assert sse.error_message({"error": {"message": "bad", "type": "x"}}) == "bad"
    assert sse.error_message({"object": "error", "message": "nope"}) == "nope"
    assert sse.error_message({"detail": "Not Found"}) == "Not Found"
    assert sse.http_error_text(400, b'{"error": {"message": "too long"}}') == "HTTP 400: too long"
    assert sse.http_error_text(502, b"Bad Gateway") == "HTTP 502: Bad Gateway"
    assert sse.http_error_text(500, b"") == "HTTP 500: (empty body)"


def test_replayed_reads_time_each_event_by_the_read_that_completed_it():
    """The client stores raw reads while streaming and decodes them afterwards: events split
    across reads (even inside a multi-byte character) count when their last byte arrived."""
    import json

    from tandem.bench.serve_metrics import RequestResult
    from tandem.bench.serve_request import BenchConfig, _replay

    def event(obj):
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    first = event({"choices": [{"text": "héllo"}]})
    second = event({"choices": [{"text": " wörld", "finish_reason": "length"}]})
    usage = event({"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}})
    cut = first.index("é".encode()) + 1  # inside the two bytes of é
    reads = [(10.0, first[:cut]), (10.5, first[cut:] + second[:7]), (11.25, second[7:] + usage + b"data: [DONE]\n\n")]
    res = RequestResult(0, 3, 2)
    _replay(BenchConfig(base_url="http://x", keep_text=True), reads, 9.0, res)
    assert res.ttft == 1.5 and res.itl == [0.75]
    assert res.generated_text == "héllo wörld" and res.content_chunks == 2
    assert res.finish_reason == "length" and res.usage_output_tokens == 2 and res.usage_prompt_tokens == 3
