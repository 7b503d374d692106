"""`peagle drafter init`, `peagle inspect` and `peagle export` on tiny Hugging Face targets."""

from __future__ import annotations

import json

import torch

from conftest import EOS_TOKEN_ID, PAD_TOKEN_ID, RESERVED_TOKEN_IDS
from peagle.cli import main
from peagle.drafters import load_drafter, read_checkpoint
from peagle.models.config import ModelConfig
from peagle.models.loader import load_model


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_peagle_head_from_init_to_aws_export(tmp_path, tiny_hf_checkpoint, capsys):
    target_dir = tiny_hf_checkpoint("llama")
    target_cfg = ModelConfig.from_dir(target_dir)
    corpus = tmp_path / "corpus.jsonl"
    frequent = list(range(10, 32))
    corpus.write_text("\n".join(json.dumps(frequent * 3 + [40 + i]) for i in range(5)))
    head = tmp_path / "head"
    assert main(["drafter", "init", "--target", str(target_dir), "--method", "peagle", "--num-layers", "2",
                 "--draft-vocab-size", "24", "--vocab-corpus", str(corpus), "--num-speculative-tokens", "6",
                 "--seed", "3", "--out", str(head)]) == 0

    target = load_model(target_dir, dtype="float32")
    drafter = load_drafter(head, target_cfg, target=target)
    cfg = drafter.config
    assert (cfg.method, cfg.num_layers, cfg.num_speculative_tokens) == ("peagle", 2, 6)
    assert cfg.mask_token_id == min(RESERVED_TOKEN_IDS)
    assert cfg.aux_layer_ids == (2, 4, 5)  # the default for an 8-layer target
    # The 22 most frequent corpus ids plus the end-of-sequence ids of config.json and generation_config.json.
    assert drafter.vocab.target_ids.tolist() == sorted({EOS_TOKEN_ID, PAD_TOKEN_ID, *frequent})
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens.weight)
    assert drafter.fc.weight.dtype == torch.float32  # the target's dtype

    assert main(["inspect", str(head), "--json", "--target", str(target_dir)]) == 0
    info = last_json(capsys)
    assert info["format"] == "speculators"
    assert (info["method"], info["num_layers"], info["num_speculative_tokens"]) == ("peagle", 2, 6)
    assert (info["draft_vocab_size"], info["target_vocab_size"]) == (24, target_cfg.vocab_size)
    assert (info["aux_layer_ids"], info["mask_token_id"]) == ([2, 4, 5], min(RESERVED_TOKEN_IDS))
    assert info["target"] == {"name_or_path": str(target_dir), "architecture": "LlamaForCausalLM", "hidden_size": 64}
    params = sum(p.numel() for p in drafter.parameters())
    assert info["num_parameters"] == params
    target_params = sum(p.numel() for p in target.parameters())
    assert info["target_parameters"] == target_params
    assert info["share_of_target"] == (params - drafter.embed_tokens.weight.numel()) / target_params
    assert info["fits_target"] is True

    aws = tmp_path / "aws"
    assert main(["export", str(head), "--format", "aws", str(aws)]) == 0
    assert read_checkpoint(aws).format == "aws"
    again = load_drafter(aws, target_cfg)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))
    capsys.readouterr()
    assert main(["export", str(head), "--format", "aws", str(aws)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(head), "--format", "speculators", str(aws), "--force"]) == 0
    assert read_checkpoint(aws).format == "speculators"


def test_eagle3_head_for_a_qwen3_target(tmp_path, tiny_hf_checkpoint, capsys):
    target_dir = tiny_hf_checkpoint("qwen3")
    head = tmp_path / "head"
    assert main(["drafter", "init", "--target", str(target_dir), "--method", "eagle3", "--out", str(head)]) == 0
    cfg = load_drafter(head, ModelConfig.from_dir(target_dir)).config
    assert (cfg.num_layers, cfg.transformer_layer_config.family, cfg.mask_token_id) == (1, "qwen3", None)
    assert cfg.draft_vocab_size == cfg.target_vocab_size  # no --draft-vocab-size: every target id

    assert main(["inspect", str(head)]) == 0
    text = capsys.readouterr().out
    assert "eagle3" in text and "1 qwen3 layers" in text and "Qwen3ForCausalLM" in text

    llama_dir = tiny_hf_checkpoint("llama")
    # The head does not fit the llama target: a failed check.
    assert main(["inspect", str(head), "--json", "--target", str(llama_dir)]) == 1
    info = last_json(capsys)
    assert info["fits_target"] is False and "family expected llama" in info["mismatch"]


def test_init_mistakes_are_reported(tmp_path, tiny_hf_checkpoint, capsys):
    target_dir = str(tiny_hf_checkpoint("llama"))
    out = str(tmp_path / "head")
    assert main(["drafter", "init", "--target", target_dir, "--method", "peagle", "--vocab-corpus",
                 str(tmp_path / "c.txt"), "--out", out]) == 1
    assert "--draft-vocab-size" in capsys.readouterr().err
    assert main(["drafter", "init", "--target", str(tmp_path / "nowhere"), "--method", "eagle3", "--out", out]) == 1
    assert "config.json" in capsys.readouterr().err
    assert main(["drafter", "init", "--target", target_dir, "--method", "eagle3", "--aux-layer-ids", "1", "2", "9",
                 "--out", out]) == 1
    assert "out of range" in capsys.readouterr().err
