"""Secrets in the settings: never in repr (logs), never on a child's command line (ps); the
child gets them through the environment its flags default to."""

from __future__ import annotations

import argparse
import os

import pytest

from tandem.cluster.settings import Settings, add_arguments
from tandem.launcher import service_argv

SECRET_ENV = ("TANDEM_ADMIN_TOKEN", "TANDEM_API_KEY", "TANDEM_REDIS_URL")


@pytest.fixture
def clean_env(monkeypatch):
    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever service_argv set
    return monkeypatch


def _child_settings(argv: list[str]) -> Settings:
    """What the child process started with ``argv`` parses (its flags read the environment now)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return Settings.from_args(parser.parse_args(argv[5:]))  # after: python -P -m tandem <role>


def test_the_admin_token_goes_to_the_child_through_the_environment(clean_env):
    settings = Settings(admin_token="tok-123456")
    assert "tok-123456" not in repr(settings)
    argv = service_argv("gateway", settings)
    assert not any("tok-123456" in arg for arg in argv) and "--admin-token" not in argv
    assert os.environ["TANDEM_ADMIN_TOKEN"] == "tok-123456"
    assert _child_settings(argv).admin_token == "tok-123456"
    argv = service_argv("gateway", Settings())  # a later cluster without one: nothing left behind
    assert "TANDEM_ADMIN_TOKEN" not in os.environ and _child_settings(argv).admin_token is None


def test_api_keys_go_to_the_child_through_the_environment(clean_env):
    settings = Settings(api_keys=["key-a-123", "key-b-456"], metrics_require_auth=True)
    assert "key-a-123" not in repr(settings)
    argv = service_argv("gateway", settings)
    assert not any("key-a" in arg or "key-b" in arg for arg in argv) and "--api-keys" not in argv
    assert os.environ["TANDEM_API_KEY"] == "key-a-123,key-b-456"
    child = _child_settings(argv)
    assert child.api_keys == ["key-a-123", "key-b-456"] and child.metrics_require_auth
    argv = service_argv("gateway", Settings())
    assert "TANDEM_API_KEY" not in os.environ
    child = _child_settings(argv)
    assert child.api_keys == [] and not child.metrics_require_auth


@pytest.mark.parametrize("url", ["redis://:pw-secret@10.0.0.5:6379/0", "rediss://user:pw-secret@redis.internal:6380/1",
                                 "unix:///run/redis.sock?password=pw-secret"])
def test_a_redis_url_with_a_password_goes_through_the_environment(clean_env, url):
    argv = service_argv("decode", Settings(redis_url=url), "decode-0")
    assert not any("pw-secret" in arg for arg in argv) and "--redis-url" not in argv
    assert os.environ["TANDEM_REDIS_URL"] == url and _child_settings(argv).redis_url == url


def test_a_redis_url_without_one_stays_on_the_command_line(clean_env):
    os.environ["TANDEM_REDIS_URL"] = "redis://:old@127.0.0.1:1/0"  # left by an earlier cluster
    argv = service_argv("decode", Settings(redis_url="redis://127.0.0.1:6390/0"), "decode-0")
    assert argv[argv.index("--redis-url") + 1] == "redis://127.0.0.1:6390/0"
    assert "TANDEM_REDIS_URL" not in os.environ
