"""OutputText: chunking never changes the text, and stop strings cut it without ever sending what is cut."""

from __future__ import annotations

import pytest

from peagle.models.loader import load_tokenizer
from peagle.server.output_text import OutputText

TEXT = "The quick brown fox jumps over the lazy dog. Café, naïve — 你好，世界 🙂🚀 done"


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_checkpoint):
    return load_tokenizer(tiny_hf_checkpoint("llama", num_layers=4))


def _run(tokenizer, ids, stops, size=1) -> tuple[str, list[str]]:
    """(all text sent, text sent so far after each feed)."""
    out, sent, history = OutputText(tokenizer, [], stops), "", []
    for i in range(0, len(ids), size):
        sent += out.feed(ids[i:i + size])
        history.append(sent)
    sent += out.finish()
    assert sent == out.text
    return sent, history


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_chunking_does_not_change_the_text(tokenizer, size):
    ids = tokenizer.encode(TEXT)
    sent, history = _run(tokenizer, ids, [], size)
    assert sent == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in h for h in history)  # a partial multi-byte character is never sent


@pytest.mark.parametrize("stops, cut_before", [
    (["fox"], "fox"), (["o"], "o"), (["lazy dog"], "lazy dog"), (["🚀"], "🚀"), (["界 🙂"], "界 🙂"),
    (["dog", "quick"], "quick"),  # the earliest stop wins, whatever the list order
    (["not in the text"], None),
])
def test_stop_strings_cut_the_text_and_are_never_sent(tokenizer, stops, cut_before):
    ids = tokenizer.encode(TEXT)
    expected = TEXT if cut_before is None else TEXT[:TEXT.find(cut_before)]
    sent, history = _run(tokenizer, ids, stops)
    assert sent == expected
    assert all(expected.startswith(h) for h in history)


def test_a_possible_stop_is_held_back_until_the_end(tokenizer):
    ids = tokenizer.encode("over the lazy dog")
    out = OutputText(tokenizer, [], ["dog!"])
    assert out.feed(ids) == "over the lazy "  # "dog" may still become "dog!"
    assert out.finish() == "dog"


def test_without_a_tokenizer_there_is_no_text():
    out = OutputText(None, [1, 2], ["x"])
    assert out.feed([3, 4]) == "" and out.finish() == "" and out.text == ""
