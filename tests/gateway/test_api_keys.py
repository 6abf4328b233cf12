"""API keys on the HTTP API, through the official openai client and plain HTTP: with keys
every /v1 request needs one (401 in OpenAI's error shape otherwise), /health stays open and
/metrics is open unless --metrics-require-auth; without keys nothing changes."""

from __future__ import annotations

import argparse

import httpx
import pytest

from tests.gateway.conftest import TEXT, register_prefill, token_script

openai = pytest.importorskip("openai")

KEYS = ["key-one-0123456789", "key-two-9876543210"]


def _client(server, api_key: str):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


def test_keys_on(serve, fake_worker, rclient, text_ids):
    fake_worker(token_script(text_ids + [2], "stop"))
    register_prefill(rclient)
    server = serve(api_keys=KEYS)
    for wrong in ("wrong", KEYS[0] + "x", KEYS[0][:-1]):
        with pytest.raises(openai.AuthenticationError) as info:
            _client(server, wrong).completions.create(model="tiny", prompt="hi", max_tokens=50)
        assert info.value.status_code == 401
        assert info.value.body == {"message": "a valid API key is needed: Authorization: Bearer <key>",
                                   "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    for key in KEYS:  # any of them
        assert _client(server, key).completions.create(model="tiny", prompt="hi", max_tokens=50).choices[0].text == TEXT
    stream = _client(server, KEYS[1]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == TEXT

    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})  # no header at all
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": KEYS[0]}).status_code == 401  # no scheme
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {KEYS[0]}"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # probes carry no key
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200
    assert 'tandem_gateway_requests_total{route="/v1/completions",status="401"}' in metrics.text
    assert not any(key in metrics.text for key in KEYS)


def test_metrics_can_require_a_key(serve):
    server = serve(api_keys=KEYS[:1], metrics_require_auth=True)
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code in (200, 503)  # open: no worker here, so 503


def test_keys_off(serve, fake_worker, rclient, text_ids):
    fake_worker(token_script(text_ids + [2], "stop"))
    server = serve()
    assert _client(server, "anything").completions.create(model="tiny", prompt="hi", max_tokens=50).choices[0].text == TEXT
    assert httpx.get(server.url + "/v1/models").status_code == 200


def test_keys_from_flags_and_the_environment(model_dir, monkeypatch):
    from tandem.cluster.settings import Settings, SettingsError, add_arguments

    monkeypatch.setenv("TANDEM_API_KEY", "env-a, env-b")

    def parse(*argv):
        parser = argparse.ArgumentParser()
        add_arguments(parser)  # reads the environment
        return Settings.from_args(parser.parse_args(list(argv)))

    assert parse().api_keys == ["env-a", "env-b"]
    assert parse("--api-key", "flag-c").api_keys == ["flag-c"]  # a flag beats its variable, as every setting's
    settings = parse("--metrics-require-auth")
    assert settings.metrics_require_auth and "env-a" not in repr(settings)
    monkeypatch.delenv("TANDEM_API_KEY")
    assert parse().api_keys == [] and not parse("--metrics-require-auth", "False").metrics_require_auth
    for bad in ("", "a,b", "a b"):
        with pytest.raises(SettingsError, match="api-key") as info:
            Settings(model=model_dir, api_keys=[bad]).resolve()
        assert bad == "" or bad not in str(info.value)  # a rejected key is not echoed either
    with pytest.raises(SettingsError, match="metrics-require-auth"):
        Settings(model=model_dir, metrics_require_auth=True).resolve()
