"""Draft vocabularies (d2t / t2d), corpus reading, and the choice of P-EAGLE's mask token."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.drafters.target import choose_mask_token_id
from peagle.drafters.vocab import DraftVocab, count_tokens, read_token_corpus


def test_worked_example_of_the_two_maps():
    vocab = DraftVocab.from_target_ids([5, 1, 4, 4], 6)
    assert vocab.d2t.tolist() == [1, 3, 3]
    assert vocab.t2d.tolist() == [False, True, False, False, True, True]
    assert vocab.target_ids.tolist() == [1, 4, 5]
    assert (vocab.size, vocab.target_vocab_size) == (3, 6)


def test_identity_vocabulary():
    vocab = DraftVocab.identity(5)
    assert vocab.target_ids.tolist() == [0, 1, 2, 3, 4] and bool(vocab.t2d.all())


def test_top_counts_with_required_ids_and_ties_to_the_lower_id():
    counts = torch.tensor([0, 9, 3, 3, 0, 7, 3, 0])
    # 9 and 7 win, then the 3s tie: ids 2 and 3 come before 6. Id 7 (end of sequence) is required despite 0.
    assert DraftVocab.from_counts(counts, 5, required_ids=[7]).target_ids.tolist() == [1, 2, 3, 5, 7]
    assert DraftVocab.from_counts(counts, 3).target_ids.tolist() == [1, 2, 5]
    with pytest.raises(ValueError, match="must lie in 1..8"):
        DraftVocab.from_counts(counts, 9, required_ids=[7])


def test_corpus_vocabulary_counts_every_sequence():
    vocab = DraftVocab.from_corpus([[4, 4, 1], [4, 2, 2], []], 6, size=3, required_ids=[0])
    assert vocab.target_ids.tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_tokens([[1, 6]], 6)
    with pytest.raises(ValueError, match="no tokens"):
        DraftVocab.from_corpus([[]], 6, size=2)


def test_inconsistent_maps_are_refused():
    with pytest.raises(ValueError, match="t2d marks 1 target ids but d2t has 2"):
        DraftVocab(d2t=torch.zeros(2, dtype=torch.long), t2d=torch.tensor([True, False, False]))
    with pytest.raises(ValueError, match="0..5"):
        DraftVocab.from_target_ids([2, 6], 6)


def test_reading_token_corpora(tmp_path):
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text("\n".join([json.dumps([1, 2, 3]), json.dumps({"input_ids": [4]}),
                                json.dumps({"token_ids": [5, 6]}), ""]))
    assert list(read_token_corpus(jsonl)) == [[1, 2, 3], [4], [5, 6]]
    text = tmp_path / "ids.txt"
    text.write_text("7 8 9\n\n10\n")
    assert list(read_token_corpus(text)) == [[7, 8, 9], [10]]
    bad = tmp_path / "words.txt"
    bad.write_text("1 2\nhello world\n")
    with pytest.raises(ValueError, match="words.txt:2: expected whitespace-separated token ids"):
        list(read_token_corpus(bad))
    with pytest.raises(ValueError, match=":1: expected a list of token ids"):
        (tmp_path / "obj.jsonl").write_text(json.dumps({"text": "hi"}))
        list(read_token_corpus(tmp_path / "obj.jsonl"))
    with pytest.raises(FileNotFoundError):
        list(read_token_corpus(tmp_path / "missing.jsonl"))


class FakeTokenizer:
    def __init__(self, reserved, vocab_size):
        self._reserved, self.vocab_size = reserved, vocab_size

    def reserved_token_ids(self):
        return self._reserved


def test_mask_token_is_a_reserved_id_else_a_padding_row():
    assert choose_mask_token_id(FakeTokenizer([12, 9, 30], 40), 40) == 9
    assert choose_mask_token_id(FakeTokenizer([], 40), 48) == 40
    with pytest.raises(ValueError, match="no token id is free"):
        choose_mask_token_id(FakeTokenizer([], 48), 48)
    with pytest.raises(ValueError, match="tokenizer"):
        choose_mask_token_id(None, 48)
