"""The OpenAI routes through the official client against real uvicorn, with and without speculation."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fixtures import MODES, make_engine, make_head, metric_samples, serve

from peagle.server import create_app

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=4)


@pytest.fixture(scope="module", params=MODES)
def server(request, target_dir, tmp_path_factory):
    """(base URL, engine) serving the tiny model as "tiny" in one speculation mode."""
    mode = request.param
    head = None if mode == "none" else make_head(target_dir, mode, tmp_path_factory.mktemp(mode) / "head")
    engine = make_engine(target_dir, head, mode)
    with serve(create_app(engine, "tiny")) as url:
        yield url, engine


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _streamed(chunks, chat: bool) -> tuple[str, list[str | None], list]:
    """(text, finish reasons of choice chunks, usage objects) of a stream."""
    text, reasons, usages = "", [], []
    for ch in chunks:
        if ch.usage is not None:
            usages.append(ch.usage)
        for choice in ch.choices:
            text += (choice.delta.content or "") if chat else choice.text
            reasons.append(choice.finish_reason)
    return text, reasons, usages


def test_chat_stream_equals_non_stream(server, client):
    _, engine = server
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    text, reasons, usages = _streamed(stream, chat=True)

    assert full.object == "chat.completion" and full.model == "tiny"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content and text == full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and reasons[-1] == "length"
    assert all(r is None for r in reasons[:-1])
    prompt_tokens = len(engine.tokenizer.encode_chat(MESSAGES))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        prompt_tokens, 24, prompt_tokens + 24)
    assert len(usages) == 1 and usages[0] == full.usage


def test_completions_stream_equals_non_stream(server, client):
    _, engine = server
    full = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    text, reasons, usages = _streamed(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **GREEDY),
                                      chat=False)
    assert full.object == "text_completion"
    assert full.choices[0].text and text == full.choices[0].text
    assert reasons[-1] == full.choices[0].finish_reason == "length"
    assert usages == []  # no include_usage: no usage chunk
    prompt_tokens = len(engine.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 24)

    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == full.choices[0].text


def test_stop_string_cuts_stream_and_non_stream_alike(server, client):
    free = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    expected = free[:free.find(stop)]
    kw = {**GREEDY, "stop": [stop]}
    full = client.completions.create(model="tiny", prompt=PROMPT, **kw)
    text, reasons, _ = _streamed(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **kw),
                                 chat=False)
    assert full.choices[0].text == text == expected
    assert full.choices[0].finish_reason == reasons[-1] == "stop"


def test_eos_ends_a_request_with_stop(server, client):
    # Without ignore_eos the request runs until the model's EOS or max_tokens; either way usage adds up.
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length")
    expected = range(8, 9) if out.choices[0].finish_reason == "length" else range(1, 9)
    assert out.usage.completion_tokens in expected
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_seeded_sampling_repeats(server, client):
    kw = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "seed": 1234,
          "extra_body": {"ignore_eos": True, "top_k": 50}}
    a = client.completions.create(model="tiny", prompt=PROMPT, **kw).choices[0].text
    b = client.completions.create(model="tiny", prompt=PROMPT, **kw).choices[0].text
    assert a == b


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_metrics_count_requests(server, client):
    url, engine = server
    before = metric_samples(httpx.get(url + "/metrics").text)
    out = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    after = metric_samples(httpx.get(url + "/metrics").text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("peagle_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("peagle_generation_tokens_total") == out.usage.completion_tokens
    assert delta("peagle_request_success_total", finished_reason="length") == 1
    for hist in ("peagle_time_to_first_token_seconds", "peagle_e2e_request_latency_seconds"):
        assert delta(hist + "_count") == 1
    assert delta("peagle_inter_token_latency_seconds_count") == out.usage.completion_tokens - 1
    assert ("peagle_kv_cache_usage_perc", ()) in after and ("peagle_num_requests_running", ()) in after
    drafts, proposed = delta("peagle_spec_decode_num_drafts_total"), delta("peagle_spec_decode_num_draft_tokens_total")
    accepted = delta("peagle_spec_decode_num_accepted_tokens_total")
    per_pos = [delta("peagle_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(engine.k)]
    if engine.k == 0:
        assert drafts == proposed == accepted == 0
    else:
        # After the prefill's token every round verifies K drafts and emits the accepted ones plus one token
        # (the last round may be cut short by max_tokens).
        assert 0 < drafts <= out.usage.completion_tokens - 1 <= drafts + accepted
        assert proposed == engine.k * drafts
        assert sum(per_pos) == accepted


def test_prefix_caching_serves_a_repeated_prompt_from_the_cache_and_counts_it(target_dir):
    engine = make_engine(target_dir, enable_prefix_caching=True, block_size=8)
    prompt = list(range(5, 45))  # 40 tokens: four blocks of 8 with a token after them
    with serve(create_app(engine, "tiny")) as url, openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                                 max_retries=0) as client:
        first = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
        before = metric_samples(httpx.get(url + "/metrics").text)
        again = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
        after = metric_samples(httpx.get(url + "/metrics").text)
    assert again.choices[0].text == first.choices[0].text
    assert (first.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens_details.cached_tokens) == (
        0, 32)  # OpenAI's usage field
    hits = after[("peagle_prefix_cache_hits_total", ())] - before[("peagle_prefix_cache_hits_total", ())]
    queries = after[("peagle_prefix_cache_queries_total", ())] - before[("peagle_prefix_cache_queries_total", ())]
    assert (hits, queries) == (32, 40)


def test_without_prefix_caching_no_prefix_cache_metrics(server, client):
    url, _ = server
    assert "prefix_cache" not in httpx.get(url + "/metrics").text
    assert client.completions.create(model="tiny", prompt=PROMPT, **GREEDY).usage.prompt_tokens_details is None


def test_sagemaker_routes_answer_as_v1(server, client):
    # /ping is the health check; /invocations takes a chat or a completion request and answers as /v1 does.
    url = server[0]
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    chat = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    got = httpx.post(url + "/invocations", json=chat).json()
    want = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    assert got["object"] == "chat.completion" and got["choices"][0]["message"]["content"] == \
        want.choices[0].message.content
    completion = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    got = httpx.post(url + "/invocations", json=completion).json()
    assert got["object"] == "text_completion" and got["choices"][0]["text"] == client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text
    for bad in (b"{not json", b'{"model": "tiny"}', b"[1, 2]"):
        r = httpx.post(url + "/invocations", content=bad, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
    bad_field = httpx.post(url + "/invocations", json={**completion, "temperature": -1})
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "temperature"


def test_a_request_may_name_any_served_name_and_the_response_names_the_first(target_dir):
    with serve(create_app(make_engine(target_dir), ["tiny", "alias"])) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
            out = c.completions.create(model="alias", prompt=PROMPT, max_tokens=4, temperature=0)
            assert out.model == "tiny" and out.choices[0].text
            assert [m.id for m in c.models.list().data] == ["tiny", "alias"]


def test_caller_request_ids_name_the_response_and_may_repeat(target_dir):
    # vLLM's: the body's request_id, else the X-Request-Id header, is the response id's tail; two requests in flight
    # with the same id both run (the engine's own ids stay unique). With request id headers on, every response
    # carries X-Request-Id.
    import asyncio

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with serve(create_app(make_engine(target_dir), "tiny", request_id_headers=True)) as url:
        r = httpx.post(url + "/v1/completions", json={**body, "request_id": "abc"})
        assert r.json()["id"] == "cmpl-abc" and r.headers["x-request-id"]
        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-7"})
        assert r.json()["id"] == "chatcmpl-trace-7" and r.headers["x-request-id"] == "trace-7"
        streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True, "request_id": "s1"})
        ids = {line for line in streamed.text.splitlines() if line.startswith("data: {")}
        assert ids and all('"id":"cmpl-s1"' in line.replace(" ", "") for line in ids)

        async def both():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*[c.post(url + "/v1/completions", json={**body, "request_id": "same"})
                                              for _ in range(2)])

        a, b = asyncio.run(both())
        assert a.status_code == b.status_code == 200 and a.json()["id"] == b.json()["id"] == "cmpl-same"
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
        assert httpx.get(url + "/health").headers["x-request-id"]  # generated when the request sent none
    with serve(create_app(make_engine(target_dir), "tiny")) as url:
        assert "x-request-id" not in httpx.post(url + "/v1/completions", json=body).headers
