"""vLLM's output controls through the real gateway: special tokens (skip_special_tokens, and
added tokens marked special beyond the special-tokens map), include_stop_str_in_output,
continuous usage stats, min_tokens (stop strings wait for it); the cached-token count whatever order the first
events arrive in."""

from __future__ import annotations

from tandem.cluster.messages import TokenEvent
from tests.gateway.conftest import build_tokenizer, parse_sse, post, token_script


def test_skip_special_tokens_false_keeps_them_in_the_text(serve, fake_worker, tokenizer):
    hello, world = (tokenizer.encode(t, add_special_tokens=False) for t in ("Hello", " world"))
    ids = hello + [1] + world  # 1: <s>
    fake_worker(token_script(ids, "length"))
    server = serve()
    skipped = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": len(ids)}).json()
    kept = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": len(ids),
                                            "skip_special_tokens": False}).json()
    assert skipped["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    assert kept["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=False) == "Hello<s> world"


def test_added_tokens_marked_special_are_skipped():
    from transformers import AddedToken

    from tandem.gateway.detokenizer import IncrementalDetokenizer, special_token_ids

    tok = build_tokenizer()  # a fresh one: the session's tokenizer fixture stays as it is
    tok.add_tokens([AddedToken("<|start_header_id|>", special=True), AddedToken("<|eom_id|>", special=True)])
    header, eom = tok.convert_tokens_to_ids(["<|start_header_id|>", "<|eom_id|>"])
    assert header not in tok.all_special_ids  # not in the special-tokens map, as in Llama 3
    ids = tok.encode("Hello", add_special_tokens=False) + [header, eom] + tok.encode(" world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1])
    assert "".join(detok.add([t]) for t in ids) == tok.decode(ids, skip_special_tokens=True) == "Hello world"
    assert {header, eom} <= special_token_ids(tok)


def test_include_stop_str_in_output(serve, fake_worker, text_ids, tokenizer):
    fake_worker(token_script(text_ids, "length"))
    server = serve()
    body = {"prompt": "hi", "max_tokens": len(text_ids), "stop": ["How"]}
    cut = post(server, "/v1/completions", body).json()["choices"][0]
    kept = post(server, "/v1/completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == ("Hello world! ", "stop")
    assert (kept["text"], kept["finish_reason"]) == ("Hello world! How", "stop")
    events = parse_sse(post(server, "/v1/completions", {**body, "include_stop_str_in_output": True,
                                                         "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello world! How"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(serve, fake_worker, text_ids):
    fake_worker(token_script(text_ids[:4], "length"))
    server = serve()
    events = parse_sse(post(server, "/v1/completions", {
        "prompt": "hi", "max_tokens": 4, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text)
    chunks = [e for e in events[:-1] if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and all("usage" in e for e in chunks)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4


def test_min_tokens_reaches_the_workers_and_holds_off_stop_strings(serve, fake_worker, tokenizer):
    """min_tokens goes to the workers (they keep EOS and stop tokens out until then); a stop
    string found in the text of the first min_tokens tokens does not end the output."""
    ids = tokenizer.encode("ab ab ab cd", add_special_tokens=False)
    worker = fake_worker(token_script(ids, "length"))
    server = serve()
    body = {"prompt": "hi", "max_tokens": len(ids), "stop": ["ab"], "min_tokens": len(ids)}
    assert post(server, "/v1/completions", {**body, "min_tokens": len(ids) + 1}).status_code == 400  # > max_tokens
    assert post(server, "/v1/completions", {**body, "min_tokens": -1}).status_code == 400
    response = post(server, "/v1/completions", body).json()
    assert worker.requests[0].sampling.min_tokens == len(ids)
    assert response["choices"][0]["text"] == "ab ab ab cd" and response["choices"][0]["finish_reason"] == "length"
    cut = post(server, "/v1/completions", {**body, "min_tokens": 0}).json()
    assert cut["choices"][0]["text"] == "" and cut["choices"][0]["finish_reason"] == "stop"



def test_cached_tokens_are_counted_when_the_first_token_arrives_second(serve, fake_worker, text_ids):
    def script(req):  # decode's token 1 overtakes prefill's token 0, which carries the cache count
        return [(0.0, TokenEvent(req.request_id, 1, [text_ids[1]])),
                (0.05, TokenEvent(req.request_id, 0, [text_ids[0]], num_cached_tokens=4)),
                (0.0, TokenEvent(req.request_id, 2, [text_ids[2]], "length"))]

    fake_worker(script)
    server = serve()
    usage = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}


def test_min_tokens_gate_counts_tokens_not_event_batches(serve, fake_worker, tokenizer):
    """No stop string may end in the text of the first min_tokens tokens (as vLLM): not in the
    last of them, and not when token 0 arrives after later ones and they are released together."""
    ids = tokenizer.encode("cd cd ab", add_special_tokens=False)
    fake = fake_worker(token_script(ids, "length"))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": len(ids), "min_tokens": len(ids),
                                            "stop": ["ab"]}).json()
    assert body["choices"][0]["text"] == "cd cd ab" and body["choices"][0]["finish_reason"] == "length"
    fake.stop()
    ids = tokenizer.encode("ab cd cd cd", add_special_tokens=False)

    def late_first(req):  # token 0 (the prefill worker's) after the decode worker's
        events = token_script(ids, "length")(req)
        return events[1:] + events[:1]

    fake_worker(late_first, worker_id="decode-fake-1")
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": len(ids), "min_tokens": 2,
                                            "stop": ["ab"]}).json()
    assert body["choices"][0]["text"] == "ab cd cd cd" and body["choices"][0]["finish_reason"] == "length"
