"""Tool calling in the Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5, Qwen3
and Hermes chat templates write it): the grammar that forces calls, and the parser that finds them in the output.

`tool_choice: "auto"` lets the model write text or calls and parses what it wrote; "required" and a named function
force one or more calls (one with `parallel_tool_calls: false`) through structured output, so the arguments always
match the function's JSON schema. A call whose JSON does not parse stays in the text, as vLLM's parser leaves it.

    parser = ToolCallParser()
    parser.feed('Let me look. <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')  # 'Let me look. '
    parser.finish()  # ('', [ToolCall(name='f', arguments='{"x": 1}')])
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools and writes calls in the Hermes format."""
    return bool(chat_template) and "tools" in chat_template and START in chat_template


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def wire(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def forcing_grammar(tools: list[dict], name: str | None, parallel: bool) -> str:
    """A Lark grammar for one call (or, with `parallel`, one or more) to `name`, or to any of `tools`."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    options = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                 "arguments": t.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return (f"start: call{'+' if parallel else ''}\n"
            f"call: {json.dumps(START + chr(10))} body {json.dumps(chr(10) + END)}\n"
            f"body: %json {json.dumps({**schema, 'x-guidance': layout})}\n")


class ToolCallParser:
    """Splits streamed text into content (sent as it comes, up to a call's start) and the calls after it."""

    def __init__(self):
        self.text = ""
        self._sent = 0

    def feed(self, delta: str) -> str:
        """The content now safe to send: text before the first call, holding back a tail that may start one."""
        self.text += delta
        start = self.text.find(START)
        end = start if start >= 0 else len(self.text) - partial_prefix(self.text, START)
        out = self.text[self._sent:max(end, self._sent)]
        self._sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet sent, the calls); with no parsable call, all the rest is content."""
        content, calls = parse_tool_calls(self.text)
        if not calls:
            rest, self._sent = self.text[self._sent:], len(self.text)
            return rest, []
        rest = content[self._sent:] if len(content) > self._sent else ""
        self._sent = len(self.text)
        return rest, calls


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls) or (text, []) if a call block does not parse."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls, rest = [], text[start:]
    while rest.lstrip().startswith(START):
        rest = rest.lstrip()[len(START):]
        body, sep, rest = rest.partition(END)
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        if not sep:
            break
    return text[:start], calls


def partial_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
