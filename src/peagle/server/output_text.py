"""OutputText: a request's text as its tokens arrive, cut at the first stop string.

Streaming and non-streaming responses both build their text here, step by step, so the two agree. A tail of the
text that could still grow into a stop string is held back until the next tokens decide it: a client must never
receive the start of a stop string that is later cut away.
"""

from __future__ import annotations

from typing import Sequence

from peagle.models.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    """`feed(ids)` returns the text now safe to send; `finish()` returns the rest. `text` is all text sent.

    With stops=["END"]: tokens of "Hello E" give "Hello " ("E" may start "END"); then tokens of "ND more" give ""
    (the stop string ends the text), and `text` stays "Hello ".
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], stops: Sequence[str] = (), *,
                 include_stop_str: bool = False, skip_special_tokens: bool = True):
        # Without a tokenizer (token-id-only checkpoints) there is no text: responses carry "" and token counts.
        self._detok = (IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
                       if tokenizer is not None else None)
        self._stops = list(stops)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str  # vLLM's include_stop_str_in_output: the text ends after the stop
        self._end: int | None = None  # where the text ends at the first stop string, once found
        self.stop_string: str | None = None  # the stop string that ended the text
        self.text = ""

    def feed(self, token_ids: Sequence[int]) -> str:
        if self._detok is None or self._end is not None:
            return ""
        self._detok.feed(token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        if self._detok is None or self._end is not None:
            return ""
        self._detok.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        full = self._detok.text
        # A stop string cannot start inside text already sent, except in the held-back window before it.
        start = max(0, len(self.text) - self._longest_stop)
        hits = [(i, s) for s in self._stops for i in [full.find(s, start)] if i >= 0]
        if hits:
            i, self.stop_string = min(hits)
            self._end = end = i + len(self.stop_string) if self._include_stop else i
        elif final:
            end = len(full)
        else:
            end = len(full) - self._partial_stop(full)
        delta = full[len(self.text):max(end, len(self.text))]
        self.text += delta
        return delta

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(self._longest_stop - 1, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self._stops):
                return n
        return 0
