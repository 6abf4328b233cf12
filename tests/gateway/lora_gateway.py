"""What the LoRA route tests share: a tiny Llama checkpoint with PEFT adapters made by peft
itself (two good ones, and one per reason a load is refused), a gateway on it with
--enable-lora, the load and unload routes, the served adapters as Redis holds them, and the
OpenAI-style error body a refusal answers with."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from tandem.cluster import keys
from tandem.cluster.lora_registry import LoraRecord
from tests.engine.lora_testing import edit_config, make_peft_adapter
from tests.gateway.conftest import ServerThread, make_settings, post

MAX_RANK = 16


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama checkpoint ("base") and adapter directories: two good ones, and one per refusal."""
    from tandem.engine.demo_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "llama")
    other_base = make_tiny_checkpoint(root / "other-base", "llama", hidden_size=48)
    files = {"base": base,
             "good": make_peft_adapter(base, root / "good", 4, 8, ["q_proj", "v_proj"], seed=1),
             "good2": make_peft_adapter(base, root / "good2", 8, 16, ["o_proj", "down_proj"], seed=2),
             "rank": make_peft_adapter(base, root / "rank32", 32, 32, ["q_proj"], seed=3),
             "shape": make_peft_adapter(other_base, root / "other-model", 4, 8, ["q_proj", "v_proj"], seed=4)}
    for name, changes in (("targets", {"target_modules": ["q_proj", "v_proj", "embed_tokens"]}),
                          ("option", {"use_dora": True})):
        files[name] = str(shutil.copytree(files["good"], root / name))
        edit_config(files[name], **changes)
    files["corrupt"] = str(shutil.copytree(files["good"], root / "corrupt"))
    with open(os.path.join(files["corrupt"], "adapter_model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    files["empty"] = str(root / "empty")
    os.mkdir(files["empty"])
    files["missing"] = str(root / "nothing-here")
    return files


@pytest.fixture
def serve_lora(lora_files, redis_url):
    """serve_lora(**settings) -> a gateway on the tiny checkpoint with --enable-lora (stopped at teardown)."""
    from tandem.gateway.app import create_app

    servers = []

    def start(**overrides) -> ServerThread:
        overrides.setdefault("enable_lora", True)
        overrides.setdefault("max_lora_rank", MAX_RANK)
        server = ServerThread(create_app(make_settings(lora_files["base"], redis_url, **overrides))).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def load(server, name: str, path: str, **kwargs) -> httpx.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, **kwargs)


def unload(server, name: str, **kwargs) -> httpx.Response:
    return post(server, "/v1/unload_lora_adapter", {"lora_name": name}, **kwargs)


def served(rclient) -> dict[str, LoraRecord]:
    return {k.decode(): LoraRecord.from_json(v) for k, v in rclient.hgetall(keys.lora_adapters()).items()}


def assert_error(response: httpx.Response, status: int, code: str | None, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    for fragment in fragments:
        assert fragment in error["message"], (fragment, error["message"])
    return error
