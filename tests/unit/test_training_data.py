"""Training data: prompt files, regeneration through the engine (resumable), shards, packing, splits."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model, load_tokenizer
from peagle.training.cod import Layout, cod_sample
from peagle.training.data import (Document, Manifest, PackedSequence, TrainingData, pack, read_documents,
                                  split_documents)
from peagle.training.regenerate import read_prompts, regenerate


def _doc(n, prompt=2, start=10):
    return Document(torch.arange(start, start + n), torch.arange(n) >= prompt)


def test_jsonl_prompts_messages_and_plain(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "Hello"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "old answer"}]},
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
        {"other": 1},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert read_prompts(path) == [
        [{"role": "user", "content": "Hello"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="p.jsonl:2"):
        read_prompts(path)


def test_truncated_sharegpt_uses_first_human_turns_of_complete_records(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "x"},
                                      {"from": "human", "value": "second question"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "greeting"}, {"from": "human", "value": "q b"}]},
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "human", "value": "cut off here"}]},
    ]
    text = json.dumps(records, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("cut off") + 3])  # the file ends mid-record
    assert read_prompts(path) == [[{"role": "user", "content": "first question"}],
                                  [{"role": "user", "content": "q b"}]]


def test_regenerate_answers_greedily_and_resumes(tiny_hf_checkpoint, tmp_path):
    checkpoint = tiny_hf_checkpoint("llama", num_layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Question number {i}?"}) for i in range(3)) + "\n")
    out = tmp_path / "data"
    kwargs = dict(max_tokens=4, batch_size=2, dtype="float32", device="cpu", max_model_len=128)
    first = regenerate(checkpoint, prompts, out, limit=2, **kwargs)
    assert [s["num_prompts"] for s in first.shards] == [2]
    shard0 = (out / "shard-00000.safetensors").read_bytes()
    manifest = regenerate(checkpoint, prompts, out, **kwargs)  # continues with the third prompt only
    assert [(s["first_prompt"], s["num_prompts"]) for s in manifest.shards] == [(0, 2), (2, 1)]
    assert (out / "shard-00000.safetensors").read_bytes() == shard0

    tokenizer = load_tokenizer(checkpoint)
    target = load_model(checkpoint, dtype="float32")
    docs = read_documents(out, tokenizer, target.config.vocab_size)
    assert len(docs) == 3
    for i, doc in enumerate(docs):
        prompt = tokenizer.encode_chat([{"role": "user", "content": f"Question number {i}?"}])
        assert doc.token_ids[:len(prompt)].tolist() == prompt
        assert not doc.loss_mask[:len(prompt)].any() and doc.loss_mask[len(prompt):].all()
        ids = torch.tensor(prompt)
        for _ in range(len(doc) - len(prompt)):  # the response is the target's own greedy continuation
            hidden = target(ids, torch.arange(ids.numel()), DenseAttention()).hidden[-1:]
            ids = torch.cat([ids, target.compute_logits(hidden).argmax(-1)])
        assert torch.equal(ids, doc.token_ids)
    with pytest.raises(ValueError, match="other prompts"):
        regenerate(checkpoint, prompts, out, **{**kwargs, "max_tokens": 5})


def test_completions_continue_each_user_turn_as_raw_text(tiny_hf_checkpoint, tmp_path, caplog):
    """A base model's data: every user turn (up to --max-turns) is a prompt of its own, tokenized as plain text; the
    target continues it greedily and the loss covers the continuation. A model without a chat template is refused
    the chat form with --completions named, and so is peagle synthesize."""
    import logging
    import shutil

    from peagle.training.synthesize import SynthesisConfig, synthesize

    base = tmp_path / "base"
    shutil.copytree(tiny_hf_checkpoint("llama", num_layers=2), base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]  # as a base model's: no chat template anywhere
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = tmp_path / "turns.jsonl"
    records = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "def add(a, b):"},
                             {"role": "user", "content": "The quick brown fox"}, {"role": "user", "content": "x"}]},
               {"prompt": "Speculative decoding drafts"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    kwargs = dict(max_tokens=4, batch_size=2, dtype="float32", device="cpu", max_model_len=128)
    with pytest.raises(ValueError, match="no chat template .*--completions"):
        regenerate(base, prompts, tmp_path / "chat", **kwargs)
    with pytest.raises(ValueError, match="no chat template .*regenerate --completions"):
        synthesize(base, tmp_path / "synth.jsonl", SynthesisConfig(count=1), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="drop --multi-turn"):
        regenerate(base, prompts, tmp_path / "both", completions=True, multi_turn=True, **kwargs)

    out = tmp_path / "data"
    with caplog.at_level(logging.INFO, logger="peagle.training.regenerate"):
        manifest = regenerate(base, prompts, out, completions=True, max_turns=2, **kwargs)
    assert "completions: 3 prompts, each user turn of 2 records (at most 2 a record)" in caplog.text
    assert manifest.source["completions"] is True and manifest.prompts_done == 3
    tokenizer = load_tokenizer(base)
    target = load_model(base, dtype="float32")
    docs = read_documents(out, tokenizer, target.config.vocab_size)
    texts = ["def add(a, b):", "The quick brown fox", "Speculative decoding drafts"]
    assert len(docs) == 3
    for text, doc in zip(texts, docs):
        prompt = tokenizer.encode(text, add_special_tokens=True)
        assert doc.token_ids[:len(prompt)].tolist() == prompt
        assert not doc.loss_mask[:len(prompt)].any() and doc.loss_mask[len(prompt):].all()
        ids = torch.tensor(prompt)
        for _ in range(len(doc) - len(prompt)):  # the target's own greedy continuation
            hidden = target(ids, torch.arange(ids.numel()), DenseAttention()).hidden[-1:]
            ids = torch.cat([ids, target.compute_logits(hidden).argmax(-1)])
        assert torch.equal(ids, doc.token_ids)


def test_manifest_refuses_foreign_data(tiny_hf_checkpoint, tmp_path):
    checkpoint = tiny_hf_checkpoint("llama", num_layers=2)
    Manifest("feedfacefeedface", 400, "other-model", {}, []).write(tmp_path)
    with pytest.raises(ValueError, match="another tokenizer"):
        read_documents(tmp_path, load_tokenizer(checkpoint), 400)
    with pytest.raises(FileNotFoundError, match="peagle regenerate"):
        read_documents(tmp_path / "missing", load_tokenizer(checkpoint), 400)


def test_packing_respects_max_length_and_document_ids():
    docs = [_doc(5), _doc(7), _doc(3), _doc(12), _doc(4, prompt=4), _doc(2)]
    packs = pack(docs, range(len(docs)), max_length=10)
    # 5 fits, +7 overflows; 7 + 3 = 10 fits; 12 is cut to 10; doc 4 has no response token, doc 5 is too short.
    assert [p.doc_lengths for p in packs] == [[5], [7, 3], [10]]
    seq = packs[1]
    assert seq.doc_ids.tolist() == [0] * 7 + [1] * 3
    assert seq.positions.tolist() == list(range(7)) + list(range(3))
    both = PackedSequence.concat(packs[:2])
    assert both.doc_ids.tolist() == [0] * 5 + [1] * 7 + [2] * 3


def test_layouts_of_concatenated_sequences_equal_the_layout_of_the_concatenation():
    seqs = [PackedSequence.of([_doc(9), _doc(6)]), PackedSequence.of([_doc(11, prompt=4)])]
    layouts = [cod_sample(s.doc_ids, s.loss_mask, 4, 1.0, 1.0) for s in seqs]
    joined = Layout.concat(layouts, [len(s) for s in seqs], [len(s.doc_lengths) for s in seqs])
    both = PackedSequence.concat(seqs)
    direct = cod_sample(both.doc_ids, both.loss_mask, 4, 1.0, 1.0)
    for name in ("anchor", "depth", "doc", "position", "target", "weight"):
        assert torch.equal(getattr(joined, name), getattr(direct, name)), name


def test_split_and_epochs_are_seeded():
    docs = [_doc(6 + i % 5, start=i) for i in range(50)]
    train, held = split_documents(docs, 0.1, 3, seed=1)
    assert len(held) == 3 and len(train) == 47
    assert split_documents(docs, 0.1, 3, seed=1)[1][0] is held[0]
    data = TrainingData(train, max_length=20, seed=0)
    first, again = data.epoch(0), TrainingData(train, 20, 0).epoch(0)
    assert [s.token_ids.tolist() for s in first] == [s.token_ids.tolist() for s in again]
    assert [s.token_ids.tolist() for s in data.epoch(1)] != [s.token_ids.tolist() for s in first]
