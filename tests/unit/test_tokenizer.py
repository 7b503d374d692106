"""Tokenizer against transformers' tokenizer loaded from the same directory."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from peagle.models.loader import load_tokenizer
from peagle.models.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Numbers 12345 and 3.14159; symbols #$% {braces}\n\ttabs and  double  spaces",
    "Café naïve résumé — 你好，世界 🙂🚀 ∑∫√",
    "<|im_start|>user\nliteral special tokens stay whole<|im_end|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Say 你好 🙂"}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama")


@pytest.fixture(scope="module")
def both(tokenizer_dir):
    return load_tokenizer(tokenizer_dir), transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(both, conversation, add_generation_prompt):
    ours, ref = both
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected_ids = ref.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt,
                                           return_dict=False)
    assert ours.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == list(expected_ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_from_separate_jinja_file(tokenizer_dir, tmp_path):
    # Newer transformers saves the template as chat_template.jinja instead of inside tokenizer_config.json.
    shutil.copytree(tokenizer_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_missing_chat_template_is_an_actionable_error(tokenizer_dir, tmp_path):
    shutil.copytree(tokenizer_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers_and_round_trip(both, text):
    ours, ref = both
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_special_ids_vocab_and_eos(both):
    ours, ref = both
    assert ours.vocab_size == len(ref) == 400
    # eos from tokenizer_config (<|im_end|>), then generation_config.json's list, then config.json's.
    assert ours.eos_token_ids == [2, 0]
    assert ours.pad_token_id == 0 and ours.bos_token_id is None


def test_reserved_token_ids_never_appear_in_text_encodings(both):
    ours, _ = both
    reserved = ours.reserved_token_ids()
    assert reserved == [3, 4, 5]
    template_ids = set(ours.encode_chat(CONVERSATIONS[1]))
    assert {1, 2} <= template_ids  # the template's own special tokens are excluded from the reserved set
    for text in TEXTS:
        assert not set(ours.encode(text)) & set(reserved)
    assert not template_ids & set(reserved)


def _split_every_token(tokenizer, text):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.feed([token_id]) for token_id in tokenizer.encode(text)]
    return detok, pieces


def test_incremental_detokenizer_holds_back_partial_characters(both):
    ours, _ = both
    text = "Say 你好 🙂🚀 and ∑√ done"
    ids = ours.encode(text)
    assert any("\ufffd" in ours.decode([i]) for i in ids)  # some tokens really are partial characters
    detok, pieces = _split_every_token(ours, text)
    assert "".join(pieces) == text == detok.text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # a partial character produced no text at its step
    assert detok.flush() == ""


def test_incremental_detokenizer_chunks_prompt_context_and_flush(both):
    ours, _ = both
    prompt = ours.encode("The answer:")
    ids = ours.encode(" Straße 你好 ok")
    detok = IncrementalDetokenizer(ours, prompt)
    out = detok.feed(ids[:3]) + detok.feed(ids[3:7]) + detok.feed(ids[7:])
    assert out == ours.decode(ids)
    # A stream cut inside a character: nothing is emitted for it until flush, which shows the replacement mark.
    cut = next(i for i in range(1, len(ids)) if ours.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(ours)
    assert "\ufffd" not in detok.feed(ids[:cut])
    assert detok.flush().endswith("\ufffd")


def test_incremental_detokenizer_skips_special_tokens(both):
    ours, _ = both
    ids = ours.encode("hi<|im_end|>")
    detok = IncrementalDetokenizer(ours)
    assert detok.feed(ids) == "hi"
    detok = IncrementalDetokenizer(ours, skip_special_tokens=False)
    assert detok.feed(ids) == "hi<|im_end|>"


def test_added_tokens_declared_only_in_tokenizer_config(tokenizer_dir, tmp_path):
    shutil.copytree(tokenizer_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["400"] = {"content": "<|tool|>", "special": True, "normalized": False,
                                             "lstrip": False, "rstrip": False, "single_word": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "call <|tool|> now"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert 400 in ours.encode(text) and ours.vocab_size == 401
    assert 400 in ours.reserved_token_ids()


def test_load_chat_template_takes_a_file_or_a_one_line_template_and_refuses_bad_ones(tmp_path):
    from peagle.models.tokenizer import load_chat_template

    text = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(text)
    assert load_chat_template(str(tmp_path / "t.jinja")) == text
    one_line = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\\n{% endfor %}"  # as typed in a shell
    assert load_chat_template(one_line) == text  # escapes decoded, as vLLM does
    with pytest.raises(ValueError, match="no such file, and not a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}{{ m }}")


@pytest.mark.parametrize("begun", ["The capital is", "  Paris, of course  "])
def test_continue_final_message_matches_transformers(both, begun):
    ours, ref = both
    conversation = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": begun}]
    text = ours.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert text == ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True)
    assert text.rstrip().endswith(begun.strip()) and "<|im_end|>" not in text[text.rindex("assistant"):]
    with pytest.raises(ValueError, match="cannot both be true"):
        ours.apply_chat_template(conversation, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="no text to continue"):
        ours.apply_chat_template(conversation[:1] + [{"role": "assistant", "content": ""}],
                                 add_generation_prompt=False, continue_final_message=True)
