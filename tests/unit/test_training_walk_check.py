"""The trainer's held-out walk agrees with the engine, draft for draft, on documents the target wrote greedily.

A gap between the two is a train/serve mismatch (features, positions, the attention rule, the vocabulary map): the
bug class that silently lowers served acceptance while the training metrics look fine.
"""

from __future__ import annotations

import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.cli import main
from peagle.models.config import ModelConfig
from peagle.models.loader import load_tokenizer
from peagle.training.data import Document, Manifest, tokenizer_fingerprint, write_shard
from peagle.training.walk_check import al, first_turns, served, walked

K = 4


@pytest.fixture(scope="module")
def greedy_documents(tiny_hf_checkpoint, tmp_path_factory):
    """Documents the tiny target answered greedily (prompt + response, loss on the response) and their data dir."""
    target = tiny_hf_checkpoint("llama", num_layers=4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 390, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(6)]
    llm = LLM(model=str(target), dtype="float32", device="cpu", max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    docs = [Document(torch.tensor(p + list(o.outputs[0].token_ids)), torch.arange(len(p) + 40) >= len(p))
            for p, o in zip(prompts, outs)]
    data = tmp_path_factory.mktemp("greedy") / "data"
    data.mkdir()
    write_shard(data / "shard-00000.safetensors", docs)
    Manifest(tokenizer_fingerprint(load_tokenizer(target)), ModelConfig.from_dir(target).vocab_size, "tiny", {},
             [{"file": "shard-00000.safetensors", "first_prompt": 0, "num_prompts": len(docs),
               "num_documents": len(docs), "num_tokens": sum(len(d) for d in docs)}]).write(data)
    return target, data, docs


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_walk_equals_served_acceptance(greedy_documents, tmp_path, method):
    target, data, docs = greedy_documents
    out = tmp_path / method
    assert main(["train", "--target", str(target), "--data", str(data), "--out", str(out), "--method", method,
                 "--num-layers", "1", "--k-train", str(K), "--max-length", "256", "--lr", "3e-3",
                 "--warmup-steps", "2", "--steps", "40", "--eval-fraction", "0", "--aux-layer-ids", "1", "2", "3",
                 "--save-every", "1000", "--seed", "1"]) == 0
    turns = first_turns(docs, max_tokens=30)  # served and walked short of the document's end
    assert len(turns) == len(docs)
    walk = walked(target, out / "final", turns, K, "float32", device="cpu")
    serve = served(target, out / "final", turns, K, "float32", device="cpu", ignore_eos=True)
    assert all(matched for _, _, matched in serve)  # the engine reproduces the documents
    assert sum(a for a, _ in walk) > 0  # drafts are accepted, so the comparison has something to compare
    assert [tuple(w) for w in walk] == [s[:2] for s in serve]  # round for round, accepted for accepted
    assert al(walk) == al(serve)


def test_an_evaluation_set_is_held_out_whole(greedy_documents, tmp_path):
    """The documents checked: a training directory's held-out split (the trainer's fraction), an evaluation set's
    first --max-documents documents whatever the fraction (the split would keep 0 of these 6)."""
    import shutil

    from peagle.training.walk_check import held_out_documents

    target, data, docs = greedy_documents
    evaluation = tmp_path / "eval"
    shutil.copytree(data, evaluation)
    manifest = Manifest.read(evaluation)
    manifest.source["evaluation_only"] = True
    manifest.write(evaluation)
    tokenizer, vocab = load_tokenizer(target), ModelConfig.from_dir(target).vocab_size
    assert held_out_documents([data], tokenizer, vocab, 0.01, 64, 0) == []
    held = held_out_documents([data, evaluation], tokenizer, vocab, 0.01, 4, 0)
    assert [d.token_ids.tolist() for d in held] == [d.token_ids.tolist() for d in docs[:4]]
