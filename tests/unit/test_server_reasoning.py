"""Reasoning parsers (vLLM's --reasoning-parser): the thinking before `</think>` comes back apart from the answer,
streamed and not, with the same greedy tokens as a server without a parser; structured output and forced tool calls
start after the thinking; requests turn thinking off (qwen3) or drop it (include_reasoning); servers whose
tokenizer cannot show the tags are refused at start-up.

The tiny tokenizer's reserved tokens 4 and 5 are renamed `<think>` and `</think>` (plain added tokens, as Qwen3's);
a logit bias on `</think>` makes the random model end its "thinking" after a few tokens."""

from __future__ import annotations

import itertools
import json
import shutil

import httpx
import pytest
from server_fixtures import make_engine, make_head, serve

from peagle.server import create_app
from peagle.server.reasoning import REASONING_PARSERS, ReasoningSplitter

END_ID = 5
THINK_TEMPLATE = (  # ChatML; Qwen3's way of turning thinking off; earlier thinking rendered; Hermes tools
    "{%- if tools %}<|im_start|>system\nYou may call: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
BASE = {"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "logit_bias": {str(END_ID): 2}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 9}}, "required": ["ok", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


def rename_think_tokens(target, special: bool = False):
    """Reserved tokens 4 and 5 become <think> and </think> in the checkpoint's tokenizer files."""
    names = {"<|reserved_1|>": "<think>", "<|reserved_2|>": "</think>"}
    tok = json.loads((target / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        if t["content"] in names:
            t["content"], t["special"] = names[t["content"]], special
    vocab = tok["model"]["vocab"]
    for old, new in names.items():
        vocab[new] = vocab.pop(old)
    (target / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    for entry in cfg["added_tokens_decoder"].values():
        if entry["content"] in names:
            entry.update(content=names[entry["content"]], special=special)
    cfg["additional_special_tokens"] = [t for t in cfg["additional_special_tokens"] if t not in names]
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))


def think_model(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny checkpoint with <think> tokens and THINK_TEMPLATE (a copy)."""
    out = tmp_path_factory.mktemp("think") / "model"
    shutil.copytree(tiny_hf_checkpoint("llama", num_layers=4), out)
    rename_think_tokens(out)
    (out / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def target(tiny_hf_checkpoint, tmp_path_factory):
    return think_model(tiny_hf_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def servers(target, tmp_path_factory):
    """{"plain": no parser, "qwen3": qwen3 parser under P-EAGLE speculation, "deepseek_r1": that parser}."""
    head = make_head(target, "peagle", tmp_path_factory.mktemp("head") / "head")
    apps = {"plain": create_app(make_engine(target), "tiny"),
            "qwen3": create_app(make_engine(target, head, "peagle"), "tiny", reasoning_parser="qwen3"),
            "deepseek_r1": create_app(make_engine(target), "tiny", reasoning_parser="deepseek_r1")}
    with serve(apps["plain"]) as a, serve(apps["qwen3"]) as b, serve(apps["deepseek_r1"]) as c:
        yield {"plain": a, "qwen3": b, "deepseek_r1": c}


def split(text: str) -> tuple[str, str]:
    """A plain server's text as the parsers split it: the thinking (start tags dropped; this model writes one) and
    the answer after the first end tag."""
    thought, answer = text.split("</think>", 1)
    return thought.replace("<think>", ""), answer


def chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={**BASE, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def chat_stream(url: str, **body) -> tuple[str, str, list[dict]]:
    """(reasoning, content, chunks' choices) of a streamed chat."""
    reasoning, content, choices = "", "", []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**BASE, **body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                delta = c["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
                choices.append(c)
    return reasoning, content, choices


def test_splitter_holds_back_partial_tags_wherever_the_text_is_cut():
    cases = {"<think>Two and two</think>\n\nFour.": ("Two and two", "\n\nFour."),
             "no tags, cut off": ("no tags, cut off", ""),
             "a</think>b</think>c<think>d": ("a", "b</think>c<think>d"),  # only the first end tag splits
             "</th</think><thin": ("</th", "<thin")}
    for text, want in cases.items():
        for cuts in itertools.chain(itertools.combinations(range(1, len(text)), 1),
                                    itertools.combinations(range(1, len(text)), 2)):
            s = ReasoningSplitter("<think>", "</think>", thinking=True)
            parts = [s.feed(text[a:b]) for a, b in zip((0, *cuts), (*cuts, len(text)))] + [s.finish()]
            for reasoning, _ in parts:
                assert "</think>" not in reasoning and "<think>" not in reasoning
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == want, (text, cuts)
    off = ReasoningSplitter("<think>", "</think>", thinking=False)
    assert [off.feed("a</think>"), off.feed("b"), off.finish()] == [("", "a</think>"), ("", "b"), ("", "")]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_and_content_split_the_plain_output(servers, parser):
    text = chat(servers["plain"])["message"]["content"]
    assert "</think>" in text and not text.startswith("</think>")  # the bias ends the thinking a few tokens in
    thought, answer = split(text)
    got = chat(servers[parser])
    assert got["message"]["reasoning"] == got["message"]["reasoning_content"] == thought
    assert got["message"]["content"] == answer and got["finish_reason"] == "length"

    reasoning, content, choices = chat_stream(servers[parser])
    assert (reasoning, content) == (thought, answer)
    assert choices[-1]["finish_reason"] == "length"


def test_include_reasoning_false_drops_the_thinking(servers):
    answer = chat(servers["plain"])["message"]["content"].split("</think>", 1)[1]
    got = chat(servers["qwen3"], include_reasoning=False)["message"]
    assert got["reasoning"] is None and got["reasoning_content"] is None and got["content"] == answer
    reasoning, content, _ = chat_stream(servers["qwen3"], include_reasoning=False)
    assert (reasoning, content) == ("", answer)


def test_qwen3_thinking_off_is_all_content_and_deepseek_r1_ignores_the_switch(servers):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    text = chat(servers["plain"], **off)["message"]["content"]
    got = chat(servers["qwen3"], **off)["message"]
    assert got["reasoning"] is None and got["content"] == text
    assert chat_stream(servers["qwen3"], **off)[:2] == ("", text)
    thought, answer = split(text)  # deepseek_r1 always thinks: the same text is split
    got = chat(servers["deepseek_r1"], **off)["message"]
    assert (got["reasoning"], got["content"]) == (thought, answer)


def test_output_cut_off_while_thinking_is_all_reasoning(servers):
    text = chat(servers["plain"], logit_bias={}, max_tokens=6)["message"]["content"]
    assert "</think>" not in text
    got = chat(servers["qwen3"], logit_bias={}, max_tokens=6)
    assert (got["message"]["reasoning"], got["message"]["content"], got["finish_reason"]) == (
        text.replace("<think>", ""), None, "length")


def test_structured_output_starts_after_the_thinking(servers):
    thought = split(chat(servers["plain"])["message"]["content"])[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    got = chat(servers["qwen3"], response_format=fmt, max_tokens=80)
    assert got["message"]["reasoning"] == thought  # free until </think>, the same greedy tokens
    obj = json.loads(got["message"]["content"])
    assert set(obj) == {"ok", "n"} and got["finish_reason"] == "stop"
    reasoning, content, _ = chat_stream(servers["qwen3"], response_format=fmt, max_tokens=80)
    assert (reasoning, content) == (thought, got["message"]["content"])
    # With thinking off the grammar starts at once, and a JSON answer cannot contain the tag.
    got = chat(servers["qwen3"], response_format=fmt, max_tokens=80, chat_template_kwargs={"enable_thinking": False})
    assert got["message"]["reasoning"] is None and set(json.loads(got["message"]["content"])) == {"ok", "n"}


def test_forced_tool_call_follows_the_thinking(servers):
    got = chat(servers["qwen3"], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
               max_tokens=80)
    assert got["finish_reason"] == "tool_calls" and got["message"]["reasoning"]
    assert got["message"]["content"] is None
    (call,) = got["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"])["city"] in (
        "Paris", "Rome")


def test_earlier_thinking_reaches_the_template_and_misuse_is_refused(servers):
    def tokens(messages) -> int:
        r = httpx.post(servers["qwen3"] + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    turn = [*MESSAGES, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And?"}]
    with_thinking = [*MESSAGES, {"role": "assistant", "content": "Hi.", "reasoning_content": "greet back"},
                     turn[2]]
    assert tokens(with_thinking) > tokens(turn)
    assert tokens([*MESSAGES, {**with_thinking[1], "reasoning": "greet back", "reasoning_content": None},
                   turn[2]]) == tokens(with_thinking)
    bad = [({"include_reasoning": False}, "plain", "include_reasoning"),
           ({"messages": [{"role": "user", "content": "x", "reasoning": "y"}]}, "qwen3", "reasoning")]
    for body, server, param in bad:
        r = httpx.post(servers[server] + "/v1/chat/completions", json={**BASE, **body}, timeout=30)
        assert r.status_code == 400 and param in r.json()["error"]["message"], r.text


def test_a_tokenizer_without_visible_tags_is_refused(tiny_hf_checkpoint, tmp_path):
    plain = tiny_hf_checkpoint("llama", num_layers=4)
    with pytest.raises(ValueError, match="no '<think>' token"):
        create_app(make_engine(plain), "tiny", reasoning_parser="qwen3")
    special = tmp_path / "special"
    shutil.copytree(plain, special)
    rename_think_tokens(special, special=True)
    with pytest.raises(ValueError, match="special token"):
        create_app(make_engine(special), "tiny", reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="expected one of qwen3, deepseek_r1"):
        create_app(make_engine(special), "tiny", reasoning_parser="granite")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}


def test_the_engine_process_starts_the_grammar_after_the_thinking(servers, target):
    # `--engine-process`: the grammar compiled in the server travels as its request and start, and the child compiles
    # it again for its own tokenizer; the answer is the engine thread's (there under P-EAGLE: lossless, the same
    # greedy tokens).
    from peagle.engine.config import EngineConfig
    from peagle.server.engine_process import EngineProcess

    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    want = chat(servers["qwen3"], response_format=fmt, max_tokens=80)
    engine, _ = EngineProcess.start(EngineConfig(model=str(target), device="cpu", dtype="float32", max_model_len=256,
                                              max_num_seqs=8, num_kv_blocks=128))
    with serve(create_app(engine, "tiny", reasoning_parser="qwen3")) as url:
        got = chat(url, response_format=fmt, max_tokens=80)
        streamed = chat_stream(url, response_format=fmt, max_tokens=80)[:2]
    assert got["message"] == want["message"] and got["finish_reason"] == want["finish_reason"] == "stop"
    assert got["message"]["reasoning"] and set(json.loads(got["message"]["content"])) == {"ok", "n"}
    assert streamed == (want["message"]["reasoning"], want["message"]["content"])
