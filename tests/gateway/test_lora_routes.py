"""LoRA adapters through the gateway (--enable-lora) against a real redis-server, a tiny Llama
checkpoint with PEFT adapters made by peft itself, and the fake decode worker: vLLM's load and
unload routes (every refused adapter a 400 naming its reason with the served set unchanged, an
unknown one a 404, LoRA off a clear 400), /v1/models, a request's model naming an adapter (its
name, path and digest in the GenerateRequest, on a failover and a resumable stream's takeover
too; unknown or unloaded: 404 model_not_found within a second on every gateway), the API-key
guard, the admin API and ``tandem admin``, and --lora-modules at startup (a bad one stops the
gateway)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
import redis.asyncio as aioredis

from tandem.cluster import keys
from tandem.cluster.lora_registry import new_record
from tandem.cluster.sampling import SamplingParams
from tandem.gateway.errors import InvalidRequest
from tests.gateway.conftest import free_port, make_settings, parse_sse, post, token_script, wait_for
from tests.gateway.lora_gateway import MAX_RANK, assert_error, load, served, unload
from tests.gateway.lora_gateway import lora_files, serve_lora  # noqa: F401 (fixtures)

KEY = "lora-test-key-0123456789"


def test_load_list_and_run_requests_with_an_adapter(serve_lora, fake_worker, rclient, lora_files, text_ids):
    worker = fake_worker(token_script(text_ids + [2], "stop"))
    server = serve_lora()
    response = load(server, "ada", lora_files["good"])
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'ada' added successfully."
    assert response.headers["content-type"].startswith("text/plain")
    record = served(rclient)["ada"]
    assert (record.path, record.rank, len(record.digest)) == (lora_files["good"], 4, 64)
    # the same adapter again: no change (its record, created time included, stays)
    assert load(server, "ada", lora_files["good"] + "/").status_code == 200
    assert served(rclient) == {"ada": record}
    assert load(server, "bea", lora_files["good2"]).status_code == 200

    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        ("tiny", None, lora_files["base"]), ("ada", "tiny", lora_files["good"]), ("bea", "tiny", lora_files["good2"])]
    assert models[1]["object"] == "model" and models[1]["created"] == record.created

    body = post(server, "/v1/completions", {"model": "ada", "prompt": "hi", "max_tokens": 50}).json()
    assert body["model"] == "ada" and body["choices"][0]["text"]
    chunks = parse_sse(post(server, "/v1/chat/completions", {
        "model": "bea", "messages": [{"role": "user", "content": "hi"}], "stream": True}).text)
    assert {c["model"] for c in chunks[:-1]} == {"bea"} and chunks[-1] == "[DONE]"
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5}).json()["model"] == "tiny"
    bea = served(rclient)["bea"]
    assert [(r.lora_name, r.lora_path, r.lora_digest) for r in worker.requests] == [
        ("ada", record.path, record.digest), ("bea", bea.path, bea.digest), ("", "", "")]
    assert "tandem_lora_adapters 2.0" in httpx.get(server.url + "/metrics").text


def test_every_refused_load_answers_its_reason_and_changes_nothing(serve_lora, rclient, lora_files, tmp_path):
    server = serve_lora()
    assert load(server, "ada", lora_files["good"]).status_code == 200
    changed = str(shutil.copytree(lora_files["good"], tmp_path / "changed"))
    assert load(server, "cid", changed).status_code == 200
    shutil.copy(os.path.join(lora_files["good2"], "adapter_model.safetensors"), changed)  # other weights, in place
    shutil.copy(os.path.join(lora_files["good2"], "adapter_config.json"), changed)
    before = served(rclient)
    refused = [  # (body, code, fragments of the message)
        ({"lora_name": "x", "lora_path": lora_files["rank"]}, "invalid_lora_adapter",
         ["--max-lora-rank (16)", "(rank)", "rank 32"]),
        ({"lora_name": "x", "lora_path": lora_files["targets"]}, "invalid_lora_adapter",
         ["modules the engine serves no LoRA on", "(targets)", "embed_tokens"]),
        ({"lora_name": "x", "lora_path": lora_files["shape"]}, "invalid_lora_adapter",
         ["not this base model's", "(shape)"]),
        ({"lora_name": "x", "lora_path": lora_files["option"]}, "invalid_lora_adapter", ["(option)", "DoRA"]),
        ({"lora_name": "x", "lora_path": lora_files["corrupt"]}, "invalid_lora_adapter",
         ["(file)", "not a readable safetensors file"]),
        ({"lora_name": "x", "lora_path": lora_files["empty"]}, "invalid_lora_adapter", ["(file)", "adapter_config.json"]),
        ({"lora_name": "x", "lora_path": lora_files["missing"]}, "invalid_lora_adapter",
         ["(file)", "no adapter directory"]),
        ({"lora_name": "ada", "lora_path": lora_files["good2"]}, "lora_adapter_exists",
         ["'ada' is already served from", lora_files["good"], "unload it first"]),
        ({"lora_name": "cid", "lora_path": changed}, "lora_adapter_exists",
         ["'cid' is already served from", "its files changed since it was loaded"]),
        ({"lora_name": "tiny", "lora_path": lora_files["good2"]}, None, ["the base model's name"]),
        ({"lora_name": lora_files["base"], "lora_path": lora_files["good2"]}, None, ["the base model's name"]),
        ({"lora_name": "", "lora_path": lora_files["good2"]}, None, ["lora_name must not be empty"]),
        ({"lora_name": " x", "lora_path": lora_files["good2"]}, None, ["not a valid name"]),
        ({"lora_name": "x", "lora_path": ""}, None, ["lora_path must not be empty"]),
        ({"lora_name": "x"}, None, ["lora_path", "Field required"]),
        ({"lora_path": lora_files["good2"]}, None, ["lora_name", "Field required"]),
        ({"lora_name": 5, "lora_path": lora_files["good2"]}, None, ["lora_name"]),
    ]
    for body, code, fragments in refused:
        error = assert_error(post(server, "/v1/load_lora_adapter", body), 400, code, *fragments)
        assert error["type"] == "invalid_request_error"
        assert served(rclient) == before, body
    not_json = httpx.post(server.url + "/v1/load_lora_adapter", content=b"{", headers={"content-type": "application/json"})
    assert_error(not_json, 400, None, "not valid JSON")
    error = assert_error(unload(server, "nobody"), 404, "lora_adapter_not_found", "'nobody' cannot be found")
    assert error["type"] == "not_found_error"
    assert_error(post(server, "/v1/unload_lora_adapter", {}), 400, None, "lora_name")
    assert served(rclient) == before
    assert unload(server, "ada").text == "Success: LoRA adapter 'ada' removed successfully."
    assert list(served(rclient)) == ["cid"]


def test_without_enable_lora_the_routes_say_so_and_adapters_are_not_models(serve, rclient, lora_files):
    server = serve()
    rclient.hset(keys.lora_adapters(), "ada", new_record("ada", lora_files["good"], "d" * 64, 4).to_json())
    for response in (load(server, "bea", lora_files["good"]), unload(server, "ada"),
                     post(server, "/v1/load_lora_adapter", {})):  # answered before the body is read
        assert_error(response, 400, "lora_not_enabled", "LoRA is not enabled", "--enable-lora")
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["tiny"]
    assert_error(post(server, "/v1/completions", {"model": "ada", "prompt": "hi"}), 404, "model_not_found",
                 "the model 'ada' does not exist; this server serves 'tiny'")
    assert list(served(rclient)) == ["ada"]


def test_model_names_resolve_on_every_gateway_and_an_unload_ends_new_requests(
        serve_lora, fake_worker, rclient, lora_files, text_ids):
    def script(req):  # the stream's tokens come slowly, the probes' (2 tokens) at once
        return token_script(text_ids[:req.max_tokens], "length", delay_s=0.1 if req.max_tokens > 2 else 0.0)(req)

    worker = fake_worker(script)
    loader, other = serve_lora(), serve_lora()
    assert_error(post(other, "/v1/completions", {"model": "ada", "prompt": "hi", "max_tokens": 2}), 404,
                 "model_not_found", "'ada' does not exist", "/v1/models")
    assert load(loader, "ada", lora_files["good"]).status_code == 200
    # a load is seen at once by another gateway (a name not found is read again)
    assert post(other, "/v1/completions", {"model": "ada", "prompt": "hi", "max_tokens": 2}).status_code == 200

    streamed: dict = {}

    def stream():
        streamed["events"] = parse_sse(post(other, "/v1/completions", {
            "model": "ada", "prompt": "hi", "max_tokens": len(text_ids), "stream": True}, timeout=30).text)

    thread = threading.Thread(target=stream)
    thread.start()
    assert wait_for(lambda: any(r.max_tokens > 2 for r in worker.requests))
    assert unload(loader, "ada").status_code == 200
    unloaded_at = time.monotonic()
    while post(other, "/v1/completions", {"model": "ada", "prompt": "hi", "max_tokens": 2}).status_code != 404:
        assert time.monotonic() - unloaded_at < 1.0, "the unload did not reach the other gateway within a second"
        time.sleep(0.05)
    assert_error(post(loader, "/v1/chat/completions", {"model": "ada", "messages": [{"role": "user", "content": "x"}]}),
                 404, "model_not_found", "'ada' does not exist")
    thread.join(30)
    events = streamed["events"]  # the stream that was running with it finished, with it
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert {e["model"] for e in events[:-1]} == {"ada"}
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == other.app.state.service.tokenizer.decode(text_ids)
    stream_request = next(r for r in worker.requests if r.max_tokens > 2)
    assert stream_request.lora_name == "ada"
    assert not [a for a in worker.aborts if a.request_id == stream_request.request_id]


def test_loading_needs_the_api_key(serve_lora, rclient, lora_files):
    server = serve_lora(api_keys=[KEY])
    assert_error(load(server, "ada", lora_files["good"]), 401, "invalid_api_key")
    assert served(rclient) == {}
    auth = {"Authorization": f"Bearer {KEY}"}
    assert load(server, "ada", lora_files["good"], headers=auth).status_code == 200
    assert_error(unload(server, "ada"), 401, "invalid_api_key")
    assert list(served(rclient)) == ["ada"]
    assert_error(httpx.get(server.url + "/v1/models"), 401, "invalid_api_key")
    assert unload(server, "ada", headers=auth).status_code == 200 and served(rclient) == {}


def test_a_failover_resubmits_the_request_with_its_adapter(serve_lora, fake_worker, rclient, lora_files, text_ids):
    def resuming(delay_s):
        def script(req):
            return token_script(text_ids[:12], "length", delay_s=delay_s)(req)[len(req.output_token_ids):]
        return script

    first = fake_worker(resuming(0.15), worker_id="decode-fake-0", ttl_s=0.5, num_free_blocks=64)
    server = serve_lora()
    assert load(server, "ada", lora_files["good"]).status_code == 200
    threading.Timer(0.8, first.die).start()
    time.sleep(0.05)
    second = fake_worker(resuming(0.0), worker_id="decode-fake-1", ttl_s=0.5, num_free_blocks=8)
    events = parse_sse(post(server, "/v1/completions", {"model": "ada", "prompt": "hi", "max_tokens": 12,
                                                         "stream": True}).text)
    assert events[-1] == "[DONE]" and {e["model"] for e in events[:-1]} == {"ada"}
    (resumed,) = second.requests
    record = served(rclient)["ada"]
    assert resumed.request_id.endswith(".1") and resumed.output_token_ids
    for request in (first.requests[0], resumed):
        assert (request.lora_name, request.lora_path, request.lora_digest) == ("ada", record.path, record.digest)


def test_a_taken_over_resumable_stream_keeps_its_adapter(serve_lora, fake_worker, rclient, redis_url, lora_files,
                                                         text_ids):
    """A resumable stream whose gateway was lost, continued by another gateway after its adapter
    was unloaded: the resubmission still names the adapter it started with."""
    from tandem.gateway.stream_log import RetainedRequest, StreamLog
    from tandem.gateway.validation import GenerationInput

    worker = fake_worker(lambda req: token_script(text_ids, "length")(req)[len(req.output_token_ids):])
    record = new_record("ada", lora_files["good"], "d" * 64, 4)  # as it was served when the stream started
    inp = GenerationInput(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(), max_tokens=len(text_ids))
    retained = RetainedRequest("cmpl-lost", False, 1, "ada", inp.with_adapter(record), False, False, True, time.time())

    async def lost_gateway():  # retained the request, then vanished before its first event
        client = aioredis.Redis.from_url(redis_url)
        await StreamLog(client, owner="gateway-lost", retention_s=60).create(retained, "decode-gone", "cmpl-lost")
        await client.delete(keys.sse_lease("cmpl-lost"))
        await client.aclose()

    asyncio.run(lost_gateway())
    assert json.loads(rclient.hget(keys.sse_request("cmpl-lost"), "request"))["inp"]["lora_name"] == "ada"
    server = serve_lora()  # serves no adapter at all
    events = parse_sse(httpx.get(server.url + "/v1/streams/cmpl-lost", timeout=30).text)
    assert events[-1] == "[DONE]" and {e["model"] for e in events[:-1]} == {"ada"}
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == text_ids
    (resubmitted,) = worker.requests
    assert (resubmitted.lora_name, resubmitted.lora_path, resubmitted.lora_digest) == ("ada", record.path, "d" * 64)


# ---- the admin API and tandem admin -------------------------------------------------------------
def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from tandem.cli import build_parser
    from tandem.gateway import admin_client

    capsys.readouterr()
    code = admin_client.main(build_parser().parse_args(argv))
    out, err = capsys.readouterr()
    return code, out[out.find("{"):], err


def test_admin_api_loads_lists_and_unloads(serve_lora, serve, rclient, lora_files, capsys):
    from tandem.gateway.admin import pb, pb_grpc

    port = free_port()
    serve_lora(admin_port=port)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.AdminStub(channel)
        reply = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="ada", path=lora_files["good"]), timeout=60)
        assert (reply.adapter.name, reply.adapter.path, reply.adapter.rank, reply.already_loaded) == (
            "ada", lora_files["good"], 4, False)
        assert reply.adapter.digest == served(rclient)["ada"].digest
        again = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="ada", path=lora_files["good"]), timeout=60)
        assert again.already_loaded and again.adapter == reply.adapter
        before = served(rclient)
        for name, path in (("x", lora_files["rank"]), ("x", lora_files["shape"]), ("x", lora_files["missing"]),
                           ("ada", lora_files["good2"]), ("tiny", lora_files["good2"]), ("", lora_files["good2"]),
                           ("x", "")):
            assert _code(lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=name, path=path), timeout=60)
                         ) == grpc.StatusCode.INVALID_ARGUMENT, (name, path)
            assert served(rclient) == before
        listed = stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=10)
        assert listed.base_model == "tiny" and list(listed.adapters) == [reply.adapter]
        assert _code(lambda: stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="nobody"), timeout=10)
                     ) == grpc.StatusCode.NOT_FOUND
        assert stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="ada"), timeout=10) == reply.adapter
        assert served(rclient) == {}

    address = f"127.0.0.1:{port}"
    code, out, _ = _cli(["admin", "--address", address, "lora-load", "bea", lora_files["good2"]], capsys)
    assert code == 0 and json.loads(out)["adapter"]["name"] == "bea" and json.loads(out)["already_loaded"] is False
    code, out, _ = _cli(["admin", "--address", address, "loras"], capsys)
    assert code == 0 and [(a["name"], a["rank"]) for a in json.loads(out)["adapters"]] == [("bea", 8)]
    code, _, err = _cli(["admin", "--address", address, "lora-load", "big", lora_files["rank"]], capsys)
    assert code == 1 and "INVALID_ARGUMENT" in err and "--max-lora-rank" in err
    code, out, _ = _cli(["admin", "--address", address, "lora-unload", "bea"], capsys)
    assert code == 0 and json.loads(out)["name"] == "bea"
    code, _, err = _cli(["admin", "--address", address, "lora-unload", "bea"], capsys)
    assert code == 1 and "NOT_FOUND" in err

    off = free_port()
    serve(admin_port=off)  # no --enable-lora
    with grpc.insecure_channel(f"127.0.0.1:{off}") as channel:
        stub = pb_grpc.AdminStub(channel)
        for call in (lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="a", path=lora_files["good"])),
                     lambda: stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="a")),
                     lambda: stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())):
            assert _code(call) == grpc.StatusCode.FAILED_PRECONDITION
    assert served(rclient) == {}


# ---- --lora-modules -----------------------------------------------------------------------------
def test_lora_modules_are_served_from_the_start_by_every_gateway_process(serve_lora, rclient, lora_files):
    modules = [f"ada={lora_files['good']}", f"bea={lora_files['good2']}"]
    first = serve_lora(lora_modules=modules)
    records = served(rclient)
    assert sorted(records) == ["ada", "bea"] and records["bea"].rank == 8
    serve_lora(lora_modules=modules)  # another gateway process with the same modules: no change
    assert served(rclient) == records
    assert [m["id"] for m in httpx.get(first.url + "/v1/models").json()["data"]] == ["tiny", "ada", "bea"]


def test_a_lora_module_that_cannot_be_served_stops_the_gateway(lora_files, redis_url, rclient):
    from tandem.gateway.app import create_app

    async def start(app):
        async with app.router.lifespan_context(app):
            pass

    def refusal(*modules: str) -> str:
        app = create_app(make_settings(lora_files["base"], redis_url, enable_lora=True, max_lora_rank=MAX_RANK,
                                       lora_modules=list(modules)))
        with pytest.raises(InvalidRequest):
            asyncio.run(start(app))
        return app.state.startup_error

    error = refusal(f"ada={lora_files['good']}", f"big={lora_files['rank']}")
    assert "'big'" in error and "--max-lora-rank (16)" in error
    assert served(rclient) == {}  # every module is checked before any is served
    rclient.hset(keys.lora_adapters(), "ada", new_record("ada", lora_files["good2"], "d" * 64, 8).to_json())
    assert "'ada' is already served from" in refusal(f"ada={lora_files['good']}")

    port = free_port()  # the gateway process: exit code 1 and the reason
    done = subprocess.run([sys.executable, "-m", "tandem", "gateway", "--model", lora_files["base"],
                           "--served-model-name", "tiny", "--redis-url", redis_url, "--port", str(port),
                           "--admin-port", "0", "--enable-lora", "--lora-modules", f"bad={lora_files['corrupt']}"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "tandem gateway: cannot load LoRA adapter 'bad'" in done.stderr and "(file)" in done.stderr
