"""Self-synthesised training prompts (Magpie-style): the target writes user turns itself.

The chat template rendered up to the start of a user turn's content (its system turn first, if it writes one) is
a prompt that asks the model for what a user would say next, e.g. for ChatML
`<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`. Sampling it at temperature ~1 with top-p gives varied
requests from the target's own distribution, with no dataset at all (Magpie: Xu et al. 2024). A user turn counts
only if the model ended it itself (its end-of-turn token before --max-tokens), and it is kept only if it passes
`PromptFilter`: not empty, within the length bounds, mostly Latin script, not degenerate repetition, no template
markup, no overlap with the benchmark sets, and new (exact and normalised text). Rounds of samples run until
`count` prompts are kept; the output keeps them in sample order, so a seed gives the same file on the same setup.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from peagle.models.loader import load_tokenizer
from peagle.models.tokenizer import Tokenizer
from peagle.training.data_sources import BenchmarkGuard, normalise, write_jsonl
from peagle.training.regenerate import Feeder, make_engine, stop_on_sigterm

logger = logging.getLogger(__name__)

_SENTINEL = "\u2063PEAGLE-USER-TURN\u2063"
_CHAR_RUN = re.compile(r"(\S)\1{29,}")  # one character 30 times in a row


@dataclass(frozen=True, slots=True, kw_only=True)
class SynthesisConfig:
    count: int
    seed: int = 0
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 0.99
    min_chars: int = 16
    max_chars: int = 2000
    min_words: int = 3
    latin_share: float = 0.9  # of the letters, at least this share Latin script
    max_repeated_trigrams: float = 0.5  # at most this share of a prompt's word trigrams repeats an earlier one
    system: str | None = None  # system turn before the user prefix; None: the template's default
    max_num_seqs: int = 1024
    max_rounds: int = 8

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"--count must be positive, got {self.count}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be positive, got {self.max_tokens}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"sampling needs --temperature > 0 and 0 < --top-p <= 1, got {self.temperature}, "
                             f"{self.top_p}")
        if not 0 < self.min_chars <= self.max_chars:
            raise ValueError(f"need 0 < --min-chars <= --max-chars, got {self.min_chars}, {self.max_chars}")


@dataclass
class SynthesisStats:
    sampled: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count

    def summary(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in self.rejected.most_common()) or "none rejected"


def user_prefix(tokenizer: Tokenizer, system: str | None = None) -> str:
    """The chat template's text up to where a user turn's content starts (after the system turn, if any)."""
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": _SENTINEL}],
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not write the user's message verbatim; cannot find its user prefix")
    return text[:text.index(_SENTINEL)]


class PromptFilter:
    """Decides which synthesised user turns to keep; remembers kept ones for deduplication."""

    def __init__(self, cfg: SynthesisConfig, guard: BenchmarkGuard | None = None, markup: tuple[str, ...] = ()):
        self.cfg = cfg
        self.guard = guard
        self.markup = tuple(m for m in markup if m)
        self.exact: set[str] = set()
        self.normalised: set[str] = set()

    def reject(self, text: str, ended: bool = True) -> str | None:
        """Why `text` is not kept (a short reason), or None after remembering it as kept."""
        reason = self._quality(text, ended)
        if reason is None:
            stripped, norm = text.strip(), normalise(text)
            if stripped in self.exact:
                reason = "duplicate"
            elif norm in self.normalised:
                reason = "near-duplicate"
            elif self.guard is not None and (self.guard.benchmark_of(stripped) or self.guard.held_out_text(stripped)):
                reason = "benchmark overlap"
            else:
                self.exact.add(stripped)
                self.normalised.add(norm)
        return reason

    def _quality(self, text: str, ended: bool) -> str | None:
        cfg = self.cfg
        text = text.strip()
        if not text:
            return "empty"
        if not ended:
            return "unfinished"
        if len(text) < cfg.min_chars:
            return "too short"
        if len(text) > cfg.max_chars:
            return "too long"
        if any(m in text for m in self.markup):
            return "template markup"
        letters = [c for c in text if c.isalpha()]
        if not letters or sum(c < "\u0250" for c in letters) < cfg.latin_share * len(letters):
            return "language"
        if len(text.split()) < cfg.min_words:
            return "too short"
        if is_repetitive(text, cfg.max_repeated_trigrams):
            return "repetition"
        return None


def is_repetitive(text: str, max_repeated_trigrams: float = 0.5) -> bool:
    """A run of one character, a line said three times, or mostly repeated word trigrams."""
    if _CHAR_RUN.search(text):
        return True
    lines = Counter(line.strip() for line in text.splitlines() if len(line.strip()) >= 10)
    if lines and max(lines.values()) >= 3:
        return True
    words = text.casefold().split()
    trigrams = list(zip(words, words[1:], words[2:]))
    return len(trigrams) >= 10 and 1 - len(set(trigrams)) / len(trigrams) > max_repeated_trigrams


def synthesize(model: str | Path, out: str | Path, cfg: SynthesisConfig, *, dtype: str = "bfloat16",
               device: str | None = None) -> SynthesisStats:
    """Samples user turns from `model` until `cfg.count` pass the filter; writes them to `out` as JSON Lines."""
    from peagle import SamplingParams

    model, out = Path(model), Path(out)
    tokenizer = load_tokenizer(model)
    if not tokenizer.chat_template:
        raise ValueError(f"{model} has no chat template (a base model?): there is no user turn to sample; continue "
                         "text prompts with `peagle regenerate --completions` instead")
    prefix = tokenizer.encode(user_prefix(tokenizer, cfg.system))
    markup = tuple(t.content for t in tokenizer.backend.get_added_tokens_decoder().values())
    keep = PromptFilter(cfg, BenchmarkGuard.builtin(), markup)
    engine = make_engine(model, speculative_config=None, dtype=dtype, device=device,
                         max_model_len=len(prefix) + cfg.max_tokens + 1, max_num_seqs=cfg.max_num_seqs,
                         seed=cfg.seed)
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens)
    stats, kept = SynthesisStats(), {}

    def finished(j: int, tokens: list[int], reason: str | None):
        ended = reason == "stop" or bool(tokens and tokens[-1] in tokenizer.eos_token_ids)
        text = tokenizer.decode(tokens)
        why = keep.reject(text, ended)
        if why is None:
            kept[j] = text.strip()
        else:
            stats.rejected[why] += 1
        return None

    share = 0.8  # the kept share assumed for the first round; later rounds use the measured one
    with stop_on_sigterm() as stopped:
        for round_ in range(cfg.max_rounds):
            need = cfg.count - len(kept)
            if need <= 0 or stopped.is_set():
                break
            n = math.ceil(need / max(share, 0.05) * 1.1)
            first, before_kept = stats.sampled, len(kept)
            Feeder(engine, cfg.max_num_seqs, stop=stopped.is_set).run(
                ((j, prefix, params) for j in range(first, first + n)), finished)
            stats.sampled = first + n if not stopped.is_set() else len(kept) + sum(stats.rejected.values())
            got = len(kept) - before_kept
            logger.info("round %d: %d of %d samples kept (%d in all)", round_, got, stats.sampled - first, len(kept))
            if got == 0:
                break
            share = len(kept) / stats.sampled
    if stopped.is_set():
        logger.warning("stopped by SIGTERM: writing the %d prompts kept so far", len(kept))
    texts = [kept[j] for j in sorted(kept)][:cfg.count]
    stats.kept = len(texts)
    system = [{"role": "system", "content": cfg.system}] if cfg.system is not None else []
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out, ({"messages": system + [{"role": "user", "content": t}]} for t in texts))
    if stats.kept < cfg.count:
        logger.warning("kept %d of the %d prompts asked for after %d samples (%s)", stats.kept, cfg.count,
                       stats.sampled, stats.summary())
    return stats
