"""Tool calling through the openai client, on a chat template that renders tools in the Hermes format: forced calls
(required, named) follow the function's schema, stream and non-stream alike, under speculation; history with
tool-call and tool-result turns is rendered; the parser finds calls in text as it streams."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from server_fixtures import make_engine, make_head, serve

from peagle.server import create_app
from peagle.server.tool_calls import ToolCallParser, parse_tool_calls

HERMES_TEMPLATE = (
    # Tool names only, so that prompts stay short for the tiny tokenizer.
    "{%- if tools %}<|im_start|>system\nYou may call: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_hf_checkpoint, tmp_path_factory):
    target = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_hf_checkpoint("llama", num_layers=4), target)
    (target / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    head = make_head(target, "peagle", tmp_path_factory.mktemp("head") / "head")
    with serve(create_app(make_engine(target, head, "peagle"), "tiny")) as url:
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _check_weather(call):
    assert call.type == "function" and call.id and call.function.name == "weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and isinstance(args["celsius"], bool) and set(args) == {"city", "celsius"}


def test_required_tool_call_follows_the_schema(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=150, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_weather(choice.message.tool_calls[0])

    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=150, temperature=0, stream=True)
    calls, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert reasons[-1] == "tool_calls" and len(calls) == 1 and calls[0].index == 0
    assert (calls[0].function.name, calls[0].function.arguments) == (
        "weather", choice.message.tool_calls[0].function.arguments)


def test_named_tool_choice_calls_that_function(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                         tool_choice={"type": "function", "function": {"name": "clock"}},
                                         parallel_tool_calls=False, max_tokens=120, temperature=0.8, seed=2)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "clock" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_history_with_tool_turns_is_rendered(server, client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Paris", "celsius": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    out = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = httpx.post(server + "/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "celsius": true}}' in text
    assert "21 degrees, sunny" in text


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
])
def test_tool_mistakes_are_400(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **fields)
    assert e.value.body["param"] == param


def test_parser_streams_content_and_holds_back_a_call():
    parser = ToolCallParser()
    sent = [parser.feed(piece) for piece in ("Checking", " now <tool", '_call>\n{"name": "f", "arguments": {"a": 1}}',
                                             "\n</tool_call>")]
    assert "".join(sent) == "Checking now "
    rest, calls = parser.finish()
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    # Not a call after all: the held-back text is content.
    broken = ToolCallParser()
    text = "see <tool_call>\nnot json\n</tool_call>"
    assert broken.feed(text) + broken.finish()[0] == text and broken.finish()[1] == []
    assert parse_tool_calls("plain") == ("plain", [])
    two = parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                           '{"name": "b", "arguments": {"x": [1]}}\n</tool_call>')
    assert two[0] == "" and [c.name for c in two[1]] == ["a", "b"]
