"""Reasoning models' thinking, split from the answer as vLLM's `--reasoning-parser` does.

Qwen3 and DeepSeek-R1 style models think between `<think>` and `</think>`, then answer. With a reasoning parser the
chat endpoint returns the thinking in the message's `reasoning` (and `reasoning_content`, the older name many
clients read) and only the answer in `content`; streamed, the same split arrives as `reasoning` and `content`
deltas. Tool calls are parsed from the answer only, and structured output (a response_format, a forced tool call)
constrains the answer only: its grammar starts after the end-of-thinking token, as vLLM's does.

- `qwen3`: thinking unless the request turns it off (`chat_template_kwargs: {"enable_thinking": false}`, whose
  template then closes the thinking in the prompt): then everything is content. The `<think>` the model may write
  first (Qwen3's first templates leave it to the model; later ones put it in the prompt) is dropped.
- `deepseek_r1`: always thinking; the same tags.
An answer cut off before `</think>` (max_tokens) is all reasoning and no content.

    splitter = REASONING_PARSERS["qwen3"].splitter(thinking=True)
    splitter.feed("<think>Two and two</th")   # ("Two and two", "")  "</th" is held back: it may end the thinking
    splitter.feed("ink>\\n\\nFour.")            # ("", "\\n\\nFour.")
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.server.tool_calls import partial_prefix


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    can_turn_off: bool = False  # whether chat_template_kwargs' enable_thinking: false means no thinking

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether a request's output begins with thinking."""
        return not (self.can_turn_off and (chat_template_kwargs or {}).get("enable_thinking", True) is False)

    def end_token_id(self, tokenizer) -> int:
        """The end-of-thinking token's id (where structured output starts); ValueError if the tokenizer lacks either
        tag as one token, as vLLM refuses such a parser at start-up."""
        ids = {}
        for tag in (self.start, self.end):
            try:
                ids[tag] = tokenizer.token_to_id(tag)
            except ValueError:
                raise ValueError(f"--reasoning-parser {self.name}: this model's tokenizer has no {tag!r} token, so "
                                 f"its output has no thinking to split off") from None
            if tokenizer.decode([ids[tag]], skip_special_tokens=True) != tag:
                raise ValueError(f"--reasoning-parser {self.name}: {tag!r} is a special token of this tokenizer, "
                                 f"left out of decoded text, so the thinking could not be found in it")
        return ids[self.end]

    def splitter(self, thinking: bool) -> "ReasoningSplitter":
        return ReasoningSplitter(self.start, self.end, thinking)


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("qwen3", can_turn_off=True), ReasoningParser("deepseek_r1"))}


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) deltas at the first end tag. A tail that may begin a tag is
    held back until the next text decides it; `finish` returns what is held."""

    def __init__(self, start: str, end: str, thinking: bool):
        self._start, self._end = start, end
        self._thinking = thinking
        self._held = ""
        self.reasoning = ""  # all reasoning sent
        self.content = ""  # all content sent

    def feed(self, delta: str) -> tuple[str, str]:
        if not self._thinking:
            self.content += delta
            return "", delta
        text = self._held + delta
        cut = text.find(self._end)
        if cut >= 0:
            self._thinking, self._held = False, ""
            return self._sent(text[:cut].replace(self._start, ""), text[cut + len(self._end):])
        keep = max(partial_prefix(text, self._end), partial_prefix(text, self._start))
        self._held = text[len(text) - keep:] if keep else ""
        return self._sent(text[:len(text) - keep].replace(self._start, ""), "")

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return self._sent(held, "") if self._thinking else ("", "")

    def _sent(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.content += content
        return reasoning, content
