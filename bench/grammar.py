"""``tandem bench grammar``: the structured-output engines side by side on one tokenizer.

For each schema of a fixed set (nested objects, enums, bounded arrays, number ranges,
required fields, a forced tool call), each engine installed (llguidance, xgrammar):

- setup: what a new request costs before its first mask (llguidance: a matcher from
  the grammar string; xgrammar: compiling the schema, uncached, and a matcher);
- mask: the time to fill one step's token bitmask, walking a valid compact document
  token by token (mean and p99 over its tokens), which is the host work a guided
  decode step adds while the forward runs.

Prints one row per (engine, schema) and, with ``--out``, writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS: dict[str, tuple[dict, object]] = {
    "nested objects": ({"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string"}, "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "integer"}}, "required": ["city", "zip"]}},
        "required": ["name", "address"]}}, "required": ["user"]},
        {"user": {"name": "Ada Lovelace", "address": {"city": "London", "zip": 12345}}}),
    "enums": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                 "size": {"enum": ["small", "medium", "large"]}},
               "required": ["color", "size"]}, {"color": "green", "size": "large"}),
    "bounded arrays": ({"type": "array", "minItems": 2, "maxItems": 8, "items": {"type": "string"}},
                       ["alpha", "beta", "gamma", "delta"]),
    "number ranges": ({"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                                         "year": {"type": "integer", "minimum": 1900,
                                                                  "maximum": 2100}},
                       "required": ["ratio", "year"]}, {"ratio": 0.25, "year": 1999}),
    "required fields": ({"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                                           "note": {"type": "string"}},
                         "required": ["id", "ok", "note"]}, {"id": 42, "ok": True, "note": "all good"}),
    "tool call": ({"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}, "required": ["name", "arguments"]},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
}


def _ordered(schema: dict, document):
    """The document with its keys in the schema's property order (the order both engines emit)."""
    if isinstance(document, dict) and "properties" in schema:
        props = schema["properties"]
        return {k: _ordered(props.get(k, {}), document[k]) for k in props if k in document}
    if isinstance(document, list):
        return [_ordered(schema.get("items", {}), d) for d in document]
    return document


def _llguidance(tokenizer, vocab_size: int):
    from llguidance import LLMatcher

    from tandem.cluster import grammars

    started = time.perf_counter()
    ll = grammars.ll_tokenizer(tokenizer, vocab_size)
    init_s = time.perf_counter() - started

    def run(schema: dict, token_ids: list[int]) -> tuple[float, list[float]]:
        import torch

        grammar = grammars.json_schema_grammar(schema)
        started = time.perf_counter()
        matcher = LLMatcher(ll, grammar, log_level=0)
        setup = time.perf_counter() - started
        mask = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
        times = []
        for token in token_ids:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            times.append(time.perf_counter() - started)
            if not (int(mask[token // 32]) >> (token % 32)) & 1 or not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")
        return setup, times

    return init_s, run


def _xgrammar(tokenizer, vocab_size: int):
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    init_s = time.perf_counter() - started

    def run(schema: dict, token_ids: list[int]) -> tuple[float, list[float]]:
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        matcher = xgr.GrammarMatcher(compiled)
        setup = time.perf_counter() - started
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        times = []
        for token in token_ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - started)
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")
        return setup, times

    return init_s, run


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar}


def run(model: str, engines: list[str]) -> list[dict]:
    from tandem.cluster.tokenizer import load_tokenizer, vocab_size

    tokenizer = load_tokenizer(model)
    vocab = vocab_size(tokenizer)
    rows = []
    for engine in engines:
        try:
            init_s, run_one = ENGINES[engine](tokenizer, vocab)
        except ImportError as exc:
            print(f"{engine}: not installed ({exc})")
            continue
        for name, (schema, document) in SCHEMAS.items():
            text = json.dumps(_ordered(schema, document), separators=(",", ":"))
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            run_one(schema, token_ids)  # warm: first-use costs are not a step's
            setup, times = run_one(schema, token_ids)
            times.sort()
            rows.append({"engine": engine, "schema": name, "tokenizer_init_s": round(init_s, 3),
                         "setup_ms": round(setup * 1e3, 3), "tokens": len(token_ids),
                         "mask_mean_us": round(statistics.fmean(times) * 1e6, 1),
                         "mask_p99_us": round(times[min(len(times) - 1, int(0.99 * len(times)))] * 1e6, 1)})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="the checkpoint (directory or GGUF) whose tokenizer the masks are for")
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--out", help="write the rows to this JSON file")


def main(args: argparse.Namespace) -> int:
    from tandem.models import resolve_model

    rows = run(resolve_model(args.model), args.engines.split(","))
    print(f"{'engine':<11} {'schema':<16} {'tokens':>6} {'setup ms':>9} {'mask mean us':>13} {'mask p99 us':>12}")
    for r in rows:
        print(f"{r['engine']:<11} {r['schema']:<16} {r['tokens']:>6} {r['setup_ms']:>9} {r['mask_mean_us']:>13} "
              f"{r['mask_p99_us']:>12}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
