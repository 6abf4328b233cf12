"""tandem bench serve spreads its requests over LoRA adapters, as vLLM's bench serve does."""

from tandem.bench.datasets import RequestSpec
from tandem.bench.serve import _config_from_args, build_parser
from tandem.bench.serve_request import build_payload


def test_lora_modules_take_the_requests_in_turn():
    args = build_parser().parse_args(["--base-url", "http://h:1", "--model", "base", "--lora-modules", "a", "b", "c"])
    cfg = _config_from_args(args)[0]
    models = [build_payload(cfg, RequestSpec(i, [5, 6], 2, 4))["model"] for i in range(5)]
    assert models == ["a", "b", "c", "a", "b"]
    plain = _config_from_args(build_parser().parse_args(["--base-url", "http://h:1", "--model", "base"]))[0]
    assert build_payload(plain, RequestSpec(0, [5], 1, 4))["model"] == "base"
