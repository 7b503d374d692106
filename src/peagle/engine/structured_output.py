"""Structured output: a grammar (JSON schema, any JSON object, regex, choice, Lark) constrains every verified row.

A request's `StructuredOutputsParams` is compiled once per tokenizer into a `Grammar` (llguidance: MIT, no
dependencies, a few microseconds per mask). Each sequence gets its own matcher, advanced over the outputs committed
so far. For a step verifying drafts d0..d(K-1), row j's mask is the grammar's after the outputs plus d0..d(j-1):
the matcher consumes the drafts it accepts, one row at a time, then rolls them back. A draft outside the grammar is
masked out at its own row, so it is rejected there and the rows after it are never used: speculative output equals
constrained decoding without speculation.

    grammar = compile_grammar(StructuredOutputsParams(json={"type": "object"}), tokenizer, vocab_size)
    masks = grammar.row_masks(seq, drafts=[17, 4], rows=3)  # [3, vocab] bool, True = allowed

A grammar may start after a token (`starts_after`, a reasoning model's end-of-thinking token, as vLLM's structured
output with a reasoning parser): rows before that token is emitted allow everything, and the matcher reads only the
tokens after it. A step whose drafts hold that token starts the grammar at the row after it.
"""

from __future__ import annotations

import json
import re
import weakref

import numpy as np

from peagle.engine.sampling_params import StructuredOutputsParams

# JSON as json.dumps writes it: whitespace only in the separators, so a model cannot pad a document without end.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Tokenizer -> LLTokenizer (~1 s to build)


def _ll_tokenizer(tokenizer):
    from llguidance import LLTokenizer

    if tokenizer not in _LL_TOKENIZERS:
        _LL_TOKENIZERS[tokenizer] = LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                                eos_token=list(tokenizer.eos_token_ids) or None)
    return _LL_TOKENIZERS[tokenizer]


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for one kind of constraint."""
    from llguidance import LLMatcher

    if params.json is not None or params.json_object:
        schema = {"type": "object"} if params.json is None else params.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in params.choice))
    return LLMatcher.grammar_from_lark(params.grammar)


class Grammar:
    """A constraint compiled for one tokenizer, with one matcher per sequence (dropped with the sequence)."""

    def __init__(self, params: StructuredOutputsParams, tokenizer, vocab_size: int, starts_after: int | None = None):
        from llguidance import LLMatcher

        if starts_after is not None and not 0 <= starts_after < vocab_size:
            raise ValueError(f"structured_outputs: the grammar's start token {starts_after} is outside the "
                             f"vocabulary [0, {vocab_size})")
        self.params = params
        self.starts_after = starts_after
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in tokenizer.eos_token_ids if t < vocab_size]
        self._ll = _ll_tokenizer(tokenizer)
        try:
            self._source = grammar_source(params)
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"structured_outputs: {e}") from None
        error = LLMatcher.validate_grammar(self._source, self._ll)
        if error:
            raise ValueError(f"structured_outputs: the grammar is invalid: {error}")
        # Sequence -> [matcher, outputs read, started]
        self._matchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _matcher(self, seq):
        """The sequence's matcher, advanced over its outputs, and whether the grammar has started."""
        from llguidance import LLMatcher

        state = self._matchers.get(seq)
        if state is None:
            state = self._matchers[seq] = [LLMatcher(self._ll, self._source), 0, self.starts_after is None]
        matcher, consumed, started = state
        new = seq.output_token_ids[consumed:]
        state[1] += len(new)
        if not started and self.starts_after in new:
            new, state[2] = new[new.index(self.starts_after) + 1:], True
        if new and state[2]:
            matcher.consume_tokens(new)  # emitted under this grammar's masks, so every one is accepted
        return matcher, state[2]

    def row_masks(self, seq, drafts: list[int], rows: int) -> np.ndarray:
        """[rows, vocab] bool: the tokens allowed at each verified row (row j after drafts 0..j-1)."""
        matcher, started = self._matcher(seq)
        if started:
            return self._grammar_rows(matcher, drafts, rows)
        masks = np.ones((rows, self.vocab_size), dtype=bool)  # free until the start token
        if self.starts_after in drafts[:rows - 1]:  # row i + 1 follows the start token: the grammar's first row
            i = drafts.index(self.starts_after)
            masks[i + 1:] = self._grammar_rows(matcher, drafts[i + 1:], rows - i - 1)
        return masks

    def _grammar_rows(self, matcher, drafts: list[int], rows: int) -> np.ndarray:
        masks = np.ones((rows, self.vocab_size), dtype=bool)
        valid = matcher.validate_tokens(drafts[:rows - 1]) if drafts and rows > 1 else 0
        masks[0] = self._mask(matcher)
        for j, token in enumerate(drafts[:valid]):
            matcher.consume_token(token)
            masks[j + 1] = self._mask(matcher)
        if valid:
            matcher.rollback(valid)
        masks[valid + 1:] = masks[valid]  # rows past an invalid draft are never used
        return masks

    def _mask(self, matcher) -> np.ndarray:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if allowed.shape[0] < self.vocab_size:  # ids the tokenizer lacks (a padded embedding) are never allowed
            allowed = np.concatenate([allowed, np.zeros(self.vocab_size - allowed.shape[0], dtype=bool)])
        if not allowed.any():  # the grammar is finished (or broken): only the end of the sequence remains
            allowed[self.eos_token_ids] = True
        return allowed


def compile_grammar(params: StructuredOutputsParams, tokenizer, vocab_size: int,
                    starts_after: int | None = None) -> Grammar:
    if tokenizer is None:
        raise ValueError("structured_outputs needs the model's tokenizer, and this model directory has none")
    return Grammar(params, tokenizer, vocab_size, starts_after)


def with_grammar(params, tokenizer, vocab_size: int, starts_after: int | None = None):
    """`params` with its structured output compiled for this tokenizer (itself if unset or compiled already). With
    `starts_after` None, a grammar compiled to start after a token keeps that start."""
    import dataclasses

    grammar = params.compiled_grammar
    if starts_after is None and grammar is not None:
        starts_after = grammar.starts_after
    if params.structured_outputs is None or (
            grammar is not None and grammar.tokenizer is tokenizer and grammar.params == params.structured_outputs
            and grammar.starts_after == starts_after):
        return params
    return dataclasses.replace(params, compiled_grammar=compile_grammar(params.structured_outputs, tokenizer,
                                                                        vocab_size, starts_after))
