"""OpenAI's Responses API through the openai client: a response carries the chat completion's text for the same
messages (greedy), streamed as the Responses events in order with their sequence numbers; input items (messages,
function calls and their outputs, earlier reasoning) reach the chat template; function tools, forced calls and
text.format json_schema work as in chat; a reasoning parser's thinking becomes a reasoning item; what is not
implemented (stored responses, other input kinds) is refused naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from server_fixtures import make_engine, make_head, serve
from test_server_reasoning import think_model

from peagle.server import create_app

WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def target(tiny_hf_checkpoint, tmp_path_factory):
    return think_model(tiny_hf_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def urls(target, tmp_path_factory):
    head = make_head(target, "peagle", tmp_path_factory.mktemp("head") / "head")
    with serve(create_app(make_engine(target, head, "peagle"), "tiny")) as plain, \
            serve(create_app(make_engine(target), "tiny", reasoning_parser="qwen3")) as thinking:
        yield {"plain": plain, "qwen3": thinking}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}


def test_a_response_carries_the_chat_completions_text(urls):
    c = client(urls["plain"])
    want = c.chat.completions.create(model="tiny", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    got = c.responses.create(instructions="Be brief.", input="Hello there", **GREEDY)
    assert got.output_text == want.choices[0].message.content and got.status == "incomplete"
    assert got.incomplete_details.reason == "max_output_tokens" and got.id.startswith("resp_")
    assert got.usage.input_tokens == want.usage.prompt_tokens and got.usage.output_tokens == 12
    assert got.usage.total_tokens == want.usage.total_tokens and got.usage.output_tokens_details.reasoning_tokens == 0
    (message,) = got.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    # the same as input items, text parts and all
    items = c.responses.create(input=[{"role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
                                      {"type": "message", "role": "user", "content": "Hello there"}], **GREEDY)
    assert items.output_text == got.output_text


def test_streamed_events_come_in_order_and_add_up_to_the_response(urls):
    c = client(urls["plain"])
    want = c.responses.create(input="Tell me a story", **GREEDY)
    events = list(c.responses.create(input="Tell me a story", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want.output_text and events[-1].response.output_text == want.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_function_calls_and_their_outputs_reach_the_template_and_forced_calls_follow_the_schema(urls, target):
    c = client(urls["plain"])
    forced = c.responses.create(input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, model="tiny", temperature=0, max_output_tokens=150)
    (call,) = [o for o in forced.output if o.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id and forced.status == "completed"
    events = list(c.responses.create(input="Weather in Paris?", tools=[WEATHER], tool_choice={
        "type": "function", "name": "weather"}, stream=True, model="tiny", temperature=0, max_output_tokens=150))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
    # a call and its output as input items: the next turn sees both (more prompt tokens than without them)
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    longer = c.responses.create(input=follow, tools=[WEATHER], **GREEDY)
    shorter = c.responses.create(input=follow[:1], tools=[WEATHER], **GREEDY)
    assert longer.usage.input_tokens > shorter.usage.input_tokens + 10


def test_text_format_json_schema_constrains_the_answer(urls):
    got = client(urls["plain"]).responses.create(input="Answer in JSON", model="tiny", temperature=0,
                                                 max_output_tokens=40, text={"format": {
                                                     "type": "json_schema", "name": "x", "schema": SCHEMA}})
    assert set(json.loads(got.output_text)) == {"ok"} and got.text.format.type == "json_schema"


def test_a_reasoning_parser_gives_a_reasoning_item(urls):
    c = client(urls["qwen3"])
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2+2?"}],
                                     temperature=0, max_tokens=20).choices[0].message
    thought = chat.model_extra["reasoning"]
    assert thought  # this model never closes its thinking in 20 tokens: all of it is reasoning
    got = c.responses.create(input="What is 2+2?", model="tiny", temperature=0, max_output_tokens=20)
    assert [o.type for o in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == thought and got.output_text == (chat.content or "")
    assert got.usage.output_tokens_details.reasoning_tokens == 20 == got.usage.output_tokens
    events = list(c.responses.create(input="What is 2+2?", stream=True, model="tiny", temperature=0,
                                     max_output_tokens=20))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].type == "reasoning"
    # an earlier turn's reasoning item reaches the template (it renders reasoning_content) with the assistant turn
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And?"}]
    with_thinking = [turn[0], {"type": "reasoning", "id": "rs_1", "summary": [],
                               "content": [{"type": "reasoning_text", "text": "greet back"}]}, *turn[1:]]
    plain = c.responses.create(input=turn, model="tiny", max_output_tokens=1)
    thinking = c.responses.create(input=with_thinking, model="tiny", max_output_tokens=1)
    assert thinking.usage.input_tokens > plain.usage.input_tokens


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
])
def test_what_is_not_implemented_is_refused_by_name(urls, fields, param):
    body = {"model": "tiny", "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client(urls["plain"]).responses.create(**body)
    assert e.value.body["param"] == param, e.value.body


def test_stored_responses_are_not_found_with_a_reason(urls):
    c = client(urls["plain"])
    for call in (lambda: c.responses.retrieve("resp_1"), lambda: c.responses.delete("resp_1"),
                 lambda: c.responses.cancel("resp_1")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "stores no responses" in e.value.body["message"]
