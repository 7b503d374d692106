"""Bad requests get the right status and an OpenAI-style error body, and leave the server serving others."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fixtures import make_engine, serve, wait_until

from peagle.server import create_app

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_hf_checkpoint):
    engine = make_engine(tiny_hf_checkpoint("llama", num_layers=4), max_num_seqs=4)
    app = create_app(engine, "tiny", api_key=KEY)
    with serve(app) as url:
        yield url, engine, app


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], headers=AUTH, timeout=60) as c:
        yield c


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": -5}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": -0.1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_k": -2}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes please"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "Hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "Hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, "messages"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3, "x"]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", [1, 2]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, "x"]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_invalid_field_is_named(http, path, body, param):
    error = _error(http.post(path, json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_prompt_longer_than_max_model_len(http, server):
    engine = server[1]
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    assert len(engine.tokenizer.encode(long_text)) > engine.max_model_len
    messages = [{"role": "user", "content": long_text}]
    error = _error(http.post("/v1/chat/completions", json={**CHAT, "messages": messages}), 400)
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert str(engine.max_model_len) in error["message"]
    error = _error(http.post("/v1/completions", json={**COMPLETION, "prompt": long_text, "stream": True}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_a_batch_names_its_bad_prompt_and_queues_nothing(http, server):
    engine = server[1]
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    error = _error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["Hi", long_text]}), 400)
    assert error["param"] == "prompt[1]" and error["code"] == "context_length_exceeded"
    error = _error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["Hi", ""]}), 400)
    assert "prompt[1]" in error["message"]
    # more sequences than the server ever runs at once: refused whole (not 503: waiting would never help)
    serving = server[2].state.serving
    error = _error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["Hi"] * (serving.max_in_flight + 1)}),
                   400)
    assert error["param"] == "prompt" and str(serving.max_in_flight) in error["message"]
    assert serving.num_in_flight == 0
    assert not engine.has_unfinished_requests()


def test_max_tokens_beyond_the_context(http, server):
    error = _error(http.post("/v1/completions", json={**COMPLETION, "max_tokens": server[1].max_model_len}), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"


def test_token_ids_outside_the_vocabulary(http, server):
    error = _error(http.post("/v1/completions", json={**COMPLETION, "prompt": [1, 2, 10**6]}), 400)
    assert "token ids" in error["message"]


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_invalid_json(http, content):
    error = _error(http.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"}),
                   400)
    assert error["code"] == "invalid_json"


def test_unknown_model_is_404(http):
    error = _error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found" and "gpt-9" in error["message"]


def test_unknown_route_answers_in_the_same_format(http):
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.get("/v1/chat/completions"), 405)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_missing_or_wrong_key_is_401(server, headers):
    for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
                               ("GET", "/v1/models", None)):
        response = httpx.request(method, server[0] + path, json=body, headers=headers)
        assert _error(response, 401)["code"] == "invalid_api_key"


def test_probes_need_no_key(server):
    assert httpx.get(server[0] + "/health").status_code == 200
    assert httpx.get(server[0] + "/metrics").status_code == 200


def test_openai_client_sees_the_errors(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=-1)
        assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="Hello")
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_bad_requests_leave_the_server_clean(http, server):
    """After every bad request above (and in any order), a good request works and nothing stays allocated."""
    for body in ({**CHAT, "max_tokens": -1}, {**CHAT, "messages": []}, {**CHAT, "model": "x"}):
        assert http.post("/v1/chat/completions", json=body).status_code >= 400
    out = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0}).json()
    assert out["choices"][0]["finish_reason"] in ("stop", "length") and out["usage"]["completion_tokens"] >= 1
    app = server[2]
    wait_until(lambda: app.state.async_engine.stats.kv_blocks_used == 0, what="KV blocks to be freed")
    stats = app.state.async_engine.stats
    assert (stats.num_running, stats.num_waiting, app.state.serving.num_in_flight) == (0, 0, 0)
