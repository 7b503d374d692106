"""The official openai client against the server: implemented fields have their documented effect (with and
without speculation), unimplemented ones answer 400 naming the field; vLLM's extra endpoints and metric names."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from server_fixtures import make_engine, make_head, metric_samples, serve

from peagle.server import create_app

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"
EOS = 2


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=4)


@pytest.fixture(scope="module", params=["none", "peagle"])
def server(request, target_dir, tmp_path_factory):
    head = None if request.param == "none" else make_head(target_dir, "peagle", tmp_path_factory.mktemp("h") / "h")
    engine = make_engine(target_dir, head, request.param)
    with serve(create_app(engine, "tiny")) as url:
        yield url, engine


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_min_tokens_holds_eos_back(client):
    force_eos = {str(EOS): 100}
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                          logit_bias=force_eos)
    assert free.usage.completion_tokens == 1 and free.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                          logit_bias=force_eos, extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens == 7 and held.choices[0].finish_reason == "stop"


def test_stop_token_ids_and_stop_reason(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logit_bias": {"77": 100}}
    out = client.completions.create(**kw, extra_body={"stop_token_ids": [77], "min_tokens": 3, "ignore_eos": True})
    choice = out.choices[0]
    assert out.usage.completion_tokens == 4 and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == 77


def test_chat_logprobs_are_the_chosen_tokens(server, client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for entry in content:
        # Greedy picks the target's most likely token, so it heads its own top list with the same logprob.
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                            logprobs=True, stream=True, extra_body={"ignore_eos": True})
    streamed = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])


def test_completion_logprobs(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert math.isclose(max(top.values()), value) and top[token] == value
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_n_choices_are_seeded_sequences(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11,
          "extra_body": {"ignore_eos": True}}
    both = client.completions.create(n=2, **kw)
    assert [c.index for c in both.choices] == [0, 1] and both.usage.completion_tokens == 16
    first = client.completions.create(**kw).choices[0].text
    second = client.completions.create(**{**kw, "seed": 12}).choices[0].text
    assert [c.text for c in both.choices] == [first, second]
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(n=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [first, second]


def test_a_batch_of_prompts_answers_each_in_order(server, client):
    """OpenAI's prompt batch: each prompt's n choices numbered prompt by prompt (prompt_index * n + i), each equal to
    that prompt's own answer, one usage for all; streamed, the same texts under the same indices."""
    prompts = [PROMPT, "Hello there", "One two three four"]
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    batch = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 18
    ids = [server[1].tokenizer.encode(p) for p in prompts[:2]]
    by_ids = client.completions.create(prompt=ids, **kw)  # a batch of token-id prompts
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone[:2]]
    seeded = {"model": "tiny", "max_tokens": 5, "temperature": 1.0, "seed": 5, "n": 2,
              "extra_body": {"ignore_eos": True}}
    two = client.completions.create(prompt=prompts[:2], **seeded)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts[:2]):  # prompt p's choices are 2p and 2p + 1, its own n = 2 answer
        own = client.completions.create(prompt=prompt, **seeded)
        assert [c.text for c in two.choices[2 * p:2 * p + 2]] == [c.text for c in own.choices]
    texts, finished = {}, set()
    for chunk in client.completions.create(prompt=prompts, stream=True, echo=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [p + a.choices[0].text for p, a in zip(prompts, alone)]


def test_truncate_prompt_tokens_keeps_the_prompt_tail(server, client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, as if only they had been sent; a prompt longer than
    the context fits once truncated."""
    engine = server[1]
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    assert len(ids) > engine.max_model_len
    kw = {"model": "tiny", "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    tail = client.completions.create(prompt=ids[-20:], **kw)
    cut = client.completions.create(prompt=ids, **{**kw, "extra_body": {"ignore_eos": True,
                                                                        "truncate_prompt_tokens": 20}})
    assert cut.usage.prompt_tokens == 20 and cut.choices[0].text == tail.choices[0].text
    short = client.completions.create(prompt=ids[:10], **{**kw, "extra_body": {"truncate_prompt_tokens": 20}})
    assert short.usage.prompt_tokens == 10  # nothing to cut
    echoed = client.completions.create(prompt=PROMPT, echo=True, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 2}})
    kept = engine.tokenizer.decode(engine.tokenizer.encode(PROMPT)[-2:])
    assert echoed.choices[0].text.startswith(kept) and not echoed.choices[0].text.startswith(PROMPT)
    chat = client.chat.completions.create(messages=MESSAGES, **{**kw, "extra_body": {"truncate_prompt_tokens": 3}})
    assert chat.usage.prompt_tokens == 3


def _prompt_reference(target_dir, ids):
    import torch

    from peagle.models.attention import DenseAttention
    from peagle.models.loader import load_model

    model = load_model(target_dir, dtype="float32")
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)])).hidden
        return torch.log_softmax(model.compute_logits(h), -1)[:-1]  # row j: the token at j + 1


def test_echo_with_logprobs_scores_the_prompt(server, client, target_dir):
    """lm-eval-harness's loglikelihood request (echo, logprobs, one new token, a batch of token-id prompts): the
    echoed prompt's tokens lead the logprobs, the first without a value, the others the target's; then the answer's."""
    tokenizer = server[1].tokenizer
    ids = tokenizer.encode(PROMPT + " jumps over the lazy dog")
    kw = {"model": "tiny", "max_tokens": 1, "temperature": 0, "logprobs": 1}
    out = client.completions.create(prompt=[ids, ids[:4]], echo=True, **kw)
    for choice, prompt in zip(out.choices, [ids, ids[:4]]):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = _prompt_reference(target_dir, prompt)
        for j, value in enumerate(lp.token_logprobs[1:len(prompt)]):
            assert math.isclose(value, float(ref[j, prompt[j + 1]]), abs_tol=1e-4)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        alone = client.completions.create(prompt=prompt, **kw).choices[0]
        assert choice.text == tokenizer.decode(prompt) + alone.text
        assert math.isclose(lp.token_logprobs[-1], alone.logprobs.token_logprobs[0], abs_tol=1e-5)
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(prompt=ids, echo=True, stream=True, **{**kw, "max_tokens": 3}):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    whole = client.completions.create(prompt=ids, echo=True, **{**kw, "max_tokens": 3}).choices[0].logprobs
    # (streamed answer offsets count the text decoded so far, which a byte-fallback token leaves short until the
    # next: compared over the echoed prompt's tokens only)
    assert tokens == whole.tokens and offsets[:len(ids)] == whole.text_offset[:len(ids)]
    assert values[0] is None and all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(values[1:],
                                                                                      whole.token_logprobs[1:]))


def test_prompt_logprobs_field(server, target_dir):
    """vLLM's prompt_logprobs: per completions choice, and once for a chat response; None for the first token, then
    {token id: {logprob, rank, decoded_token}} holding the prompt token and the top alternatives."""
    ids = server[1].tokenizer.encode(PROMPT)
    ref = _prompt_reference(target_dir, ids)
    with httpx.Client(base_url=server[0], timeout=60) as http:
        body = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                  "prompt_logprobs": 2, "n": 2, "temperature": 0}).json()
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                       "prompt_logprobs": 0}).json()
    for choice in body["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for j, entry in enumerate(plp[1:]):
            mine = entry[str(ids[j + 1])]
            assert math.isclose(mine["logprob"], float(ref[j, ids[j + 1]]), abs_tol=1e-4)
            assert mine["rank"] == int((ref[j] > ref[j, ids[j + 1]]).sum()) + 1
            assert {int(t) for t in entry} == {ids[j + 1], *ref[j].topk(2).indices.tolist()}
    plp = chat["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in plp[1:])  # 0 alternatives: the prompt token alone


def test_bad_words_change_the_output(server, client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    tokenizer = server[1].tokenizer
    word = tokenizer.decode(tokenizer.encode(plain)[3:5])
    banned = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": [word]}).choices[0].text
    assert banned != plain and banned[:len(plain.split(word)[0])] == plain.split(word)[0]


def test_penalties_change_the_output(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(**kw).choices[0].text
    penalised = client.completions.create(**kw, presence_penalty=2.0, frequency_penalty=2.0).choices[0].text
    assert penalised != plain


def test_echo_prepends_the_prompt(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("endpoint, fields, param", [
    ("chat", {"tools": [TOOL]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ("chat", {"extra_body": {"guided_decoding_backend": "xgrammar"}}, "guided_decoding_backend"),
    ("chat", {"extra_body": {"structural_tag": "{}"}}, "structural_tag"),
    ("chat", {"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ("chat", {"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ("chat", {"extra_body": {"bad_words": ["  "]}}, "bad_words"),
    ("chat", {"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
    ("chat", {"extra_body": {"no_such_option": 1}}, "no_such_option"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"extra_body": {"thinking_token_budget": 10}}, "thinking_token_budget"),
    ("chat", {"extra_body": {"include_reasoning": False}}, "include_reasoning"),  # no --reasoning-parser here
    ("chat", {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"extra_body": {"guided_choice": []}}, "guided_choice"),
    ("completions", {"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ("chat", {"extra_body": {"truncate_prompt_tokens": -2}}, "truncate_prompt_tokens"),
])
def test_unimplemented_fields_are_refused(client, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **fields})
        else:
            client.completions.create(**{"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **fields})
    error = e.value.body
    assert error["param"] == param and param.split(".")[-1] in error["message"], error


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                         response_format=fmt)
    obj = json.loads(out.choices[0].message.content)
    assert set(obj) == {"ok", "tag"} and isinstance(obj["ok"], bool) and obj["tag"] in ("red", "green", "blue")
    assert out.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"}, extra_body={"min_p": 0.5})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")


def test_guided_choice_and_regex(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": ["alpha", "beta"]})
    assert out.choices[0].text in ("alpha", "beta")
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "[a-c]{4}"})
    assert len(out.choices[0].text) == 4 and set(out.choices[0].text) <= set("abc")


def test_no_op_values_are_accepted(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tools=[],
                                         response_format={"type": "text"}, user="someone")
    assert out.choices[0].message.content is not None


def test_models_retrieve_and_vllm_endpoints(server, client):
    url, engine = server
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    ids = httpx.post(url + "/tokenize", json={"prompt": PROMPT}).json()
    assert ids["tokens"] == engine.tokenizer.encode(PROMPT, add_special_tokens=True) and ids["count"] == len(
        ids["tokens"])
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == engine.tokenizer.encode_chat(MESSAGES)
    assert httpx.post(url + "/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": PROMPT}
    assert httpx.post(url + "/detokenize", json={"tokens": [10 ** 6]}).status_code == 400
    assert httpx.get(url + "/version").json()["version"]


def test_vllm_metric_names(server, client):
    url, engine = server
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
    samples = metric_samples(httpx.get(url + "/metrics").text)
    label = (("model_name", "tiny"),)
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "generation_tokens_total", "prompt_tokens_total"):
        assert samples[(f"vllm:{name}", label)] == samples[(f"peagle_{name}", ())]
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*label, ("position", str(i))))]
               for i in range(engine.k)]
    assert sum(per_pos) == samples[("vllm:spec_decode_num_accepted_tokens_total", label)]
    if engine.k:
        assert samples[("vllm:spec_decode_num_drafts_total", label)] > 0
