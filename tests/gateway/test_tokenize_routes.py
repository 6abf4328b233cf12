"""vLLM's /tokenize and /detokenize, and the model and version routes: the served tokenizer as the
generation endpoints use it (the chat form is the prompt a chat completion sends its worker), bad
input a 400 naming its field, an unknown model a 404, and behind the API key like /v1."""

from __future__ import annotations

import httpx

import tandem
from tests.gateway.conftest import MAX_POSITIONS, post, token_script

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


def test_tokenize_is_what_the_generation_endpoints_send(serve, fake_worker, tokenizer):
    worker = fake_worker(token_script([5], "length"))
    server = serve()
    body = post(server, "/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert body == {"count": len(ids), "max_model_len": MAX_POSITIONS, "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    bare = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False) and bare["token_strs"] is None

    assert post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 1}).status_code == 200
    assert worker.requests[-1].prompt_token_ids == ids
    for form in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        chat = {"messages": MESSAGES, **form}
        tokens = post(server, "/tokenize", chat).json()["tokens"]
        assert post(server, "/v1/chat/completions", {**chat, "max_tokens": 1}).status_code == 200
        assert worker.requests[-1].prompt_token_ids == tokens


def test_detokenize_and_bad_input(serve, tokenizer):
    server = serve()
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    cases = [("/detokenize", {"tokens": [10**6]}, "tokens"), ("/detokenize", {"tokens": []}, "tokens"),
             ("/detokenize", {"tokens": ["a"]}, "tokens"), ("/tokenize", {}, "prompt"),
             ("/tokenize", {"prompt": 5}, "prompt"),
             ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, None),
             ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")]
    for path, body, param in cases:
        response = post(server, path, body)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    response = httpx.post(server.url + "/tokenize", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    for path, body in (("/tokenize", {"model": "nope", "prompt": "x"}), ("/detokenize", {"model": "nope", "tokens": [1]})):
        assert post(server, path, body).status_code == 404


def test_model_and_version_routes(serve):
    server = serve()
    card = httpx.get(server.url + "/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["object"] == "model" and card["parent"] is None
    assert card == httpx.get(server.url + "/v1/models").json()["data"][0]
    missing = httpx.get(server.url + "/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/version").json() == {"version": tandem.__version__}


def test_tokenize_routes_need_the_api_key(serve):
    server = serve(api_keys=["key-0123456789"])
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body).status_code == 401
        assert post(server, path, body, headers={"Authorization": "Bearer key-0123456789"}).status_code == 200
    assert httpx.get(server.url + "/version").status_code == 200
