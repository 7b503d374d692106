"""Tokenizer: tokenizer.json (through `tokenizers`) plus tokenizer_config.json (chat template, special tokens).

The chat template is rendered with jinja2 in the environment transformers uses (sandboxed, trim_blocks,
lstrip_blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`), so prompts match
`apply_chat_template` without importing transformers.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from peagle.models.config import not_a_checkpoint

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
Message = dict[str, Any]


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        eos_token_ids: Sequence[int] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_ids = list(dict.fromkeys([*([self.token_to_id(eos)] if eos else []), *eos_token_ids]))

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not path.is_dir():
            raise FileNotFoundError(not_a_checkpoint(path))
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json; peagle reads fast (tokenizers) tokenizers only. "
                "Re-save the tokenizer with transformers' PreTrainedTokenizerFast.save_pretrained"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the tokenizers library raises bare Exceptions for malformed files
            raise ValueError(f"{tokenizer_file} is not a readable tokenizer.json: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        _add_missing_tokens(backend, config.get("added_tokens_decoder") or {})
        special = {k: _token_content(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        eos_ids = [*_ids(_read_json(path / "generation_config.json").get("eos_token_id")),
                   *_ids(_read_json(path / "config.json").get("eos_token_id"))]
        return cls(backend, chat_template=_chat_template(path, config), special_tokens=special, eos_token_ids=eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens["bos_token"]) if "bos_token" in self.special_tokens else None

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens["pad_token"]) if "pad_token" in self.special_tokens else None

    def token_to_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return token_id

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, continue_final_message: bool = False,
        **template_kwargs: Any
    ) -> str:
        """The prompt string for a conversation, as transformers renders it (extra kwargs reach the template).

        `continue_final_message` (transformers' and vLLM's): the last message is left open, everything the template
        writes after its content cut off, so that the model continues it (a response begun for it)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second starts a new one")
        if continue_final_message and not messages:
            raise ValueError("continue_final_message needs a message to continue")
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (none in tokenizer_config.json or chat_template.jinja); "
                "pass a raw prompt instead of chat messages"
            )
        # tools and documents may come in template_kwargs (as transformers takes them); None when not given.
        context = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        text = _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **context,
        )
        if continue_final_message:
            text = _cut_after_final(text, messages[-1].get("content"))
        return text

    def with_chat_template(self, chat_template: str) -> "Tokenizer":
        """This tokenizer with another chat template (a shallow copy: the vocabulary is shared)."""
        other = copy.copy(self)
        other.chat_template = chat_template
        return other

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        # The template writes every special token itself, so none is added on top (as transformers does).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                    **template_kwargs))

    def reserved_token_ids(self) -> list[int]:
        """Special tokens no text produces and the chat template never writes: safe to repurpose (a mask token).

        Excludes bos/eos/pad/unk and every token whose text appears in the chat template.
        """
        used = {self.backend.token_to_id(t) for t in self.special_tokens.values()} | set(self.eos_token_ids)
        template = self.chat_template or ""
        return sorted(
            token_id
            for token_id, token in self.backend.get_added_tokens_decoder().items()
            if token.special and token_id not in used and token.content not in template
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, emitting only completed characters.

    A byte-level token may end in the middle of a multi-byte character; its text then ends in U+FFFD and is held
    back until a later token completes it. Each step decodes a short window (the previously emitted tokens since the
    last emission plus the new ones) so that tokenizers whose decoders look at neighbours (leading spaces) stay
    correct, and the cost per token stays constant.

        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        for ids in stream: print(detok.feed(ids), end="")
        print(detok.flush())
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True,
                 context: int = 5):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-context:]) if context else []
        self._prefix = 0  # window start: tokens already emitted, kept as context
        self._read = len(self._ids)  # tokens before this index have been emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_ids: Iterable[int]) -> str:
        """Adds tokens; returns the text they complete ("" while a character is still partial)."""
        self._ids.extend(token_ids)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before):]
        self._ids = self._ids[self._read:]
        self._prefix, self._read = 0, len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the stream: the held-back text, with U+FFFD for bytes that never completed."""
        before = self._decode(self._ids[self._prefix:self._read])
        new = self._decode(self._ids[self._prefix:])[len(before):]
        self._ids, self._prefix, self._read = [], 0, 0
        self.text += new
        return new


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken dict.
    return value.get("content") if isinstance(value, dict) else value


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _add_missing_tokens(backend: BackendTokenizer, added: dict[str, dict]) -> None:
    # tokenizer_config.json may declare added tokens that tokenizer.json lacks; transformers adds them too.
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    for _, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        if spec["content"] in known:
            continue
        flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
        token = AddedToken(spec["content"], **{flag: bool(spec.get(flag, False)) for flag in flags})
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])


def _cut_after_final(text: str, content: Any) -> str:
    """`text` up to the end of the last occurrence of the final message's content (as written, else stripped, as
    templates that trim messages write it), as transformers' continue_final_message cuts it."""
    if isinstance(content, list):  # parts: the last text part is what the template wrote last
        content = next((p.get("text", "") for p in reversed(content) if p.get("type") == "text"), "")
    content = content or ""
    if not content.strip():
        raise ValueError("continue_final_message: the final message has no text to continue")
    for wanted in (content, content.strip()):
        at = text.rfind(wanted)
        if at >= 0:
            return text[:at + len(wanted)]
    raise ValueError("continue_final_message: the final message does not appear in the rendered chat")


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: the path of a file, or the template itself in one
    line (escapes such as \\n decoded). Checked by compiling it, so a bad template fails at start-up, not on the
    first request."""
    import codecs

    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif any(c in value for c in "{}\n"):
        text = codecs.decode(value, "unicode_escape")
    else:
        raise ValueError(f"chat template {value!r}: no such file, and not a template (a template has {{ }} tags)")
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {value!r:.80}: not a valid Jinja template (line {e.lineno}: {e.message})"
                         ) from None
    return text


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # Newer saves put the template in its own file; older ones in tokenizer_config.json, possibly as named variants.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
