"""Drafter checkpoints: save/load, the speculators and HF-Llama-style (AWS) layouts, and fit checks on load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from peagle.drafters import (Drafter, DrafterMismatchError, export_drafter, load_drafter, read_checkpoint, read_config,
                             save_drafter)
from peagle.models.attention import DenseAttention
from test_drafters_forward import K, random_drafter, tiny_target


def run(drafter, seed: int = 0) -> torch.Tensor:
    """Logits of one P-EAGLE-shaped pass (6 real slots, then MASK slots for peagle heads)."""
    cfg = drafter.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.target_vocab_size, (6,), generator=gen)
    feats = torch.randn(6, cfg.feature_size, generator=gen)
    if drafter.mask_hidden is not None:
        ids = torch.cat([ids, torch.full((K - 1,), cfg.mask_token_id)])
        feats = torch.cat([feats, drafter.mask_hidden.detach().float().expand(K - 1, -1)])
    with torch.no_grad():
        hidden = drafter.fc(feats.to(drafter.fc.weight.dtype))
        out = drafter(ids, torch.arange(len(ids)), DenseAttention([len(ids)]), hidden)
        return drafter.compute_logits(out)


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_is_bit_exact(tmp_path, method, dtype):
    drafter = random_drafter(method, num_layers=2).to(dtype)
    save_drafter(drafter, tmp_path / "head")
    loaded = load_drafter(tmp_path / "head", tiny_target().config)
    lc = dataclasses.replace(drafter.config.transformer_layer_config, torch_dtype=str(dtype).removeprefix("torch."))
    assert loaded.config == dataclasses.replace(drafter.config, transformer_layer_config=lc)
    assert_same_state(drafter, loaded)
    assert torch.equal(run(drafter), run(loaded))
    assert not loaded.training
    assert load_drafter(tmp_path / "head", tiny_target().config, dtype="float32").fc.weight.dtype == torch.float32


def test_disk_layout_is_the_speculators_one(tmp_path):
    drafter = random_drafter("peagle", num_layers=2)
    save_drafter(drafter, tmp_path / "head")
    tensors = load_file(tmp_path / "head" / "model.safetensors")
    d, hq, hkv = 32, 4 * 8, 2 * 8
    expected = {
        "embed_tokens.weight": (64, d), "fc.weight": (d, 3 * d), "norm.weight": (d,), "lm_head.weight": (31, d),
        "d2t": (31,), "t2d": (64,), "mask_hidden": (1, 1, 3 * d),
        "layers.0.hidden_norm.weight": (d,), "layers.0.input_layernorm.weight": (d,),
        "layers.0.self_attn.q_proj.weight": (hq, 2 * d), "layers.0.self_attn.k_proj.weight": (hkv, 2 * d),
        "layers.0.self_attn.v_proj.weight": (hkv, 2 * d), "layers.0.self_attn.o_proj.weight": (d, hq),
        "layers.0.post_attention_layernorm.weight": (d,), "layers.0.mlp.gate_proj.weight": (48, d),
        "layers.0.mlp.up_proj.weight": (48, d), "layers.0.mlp.down_proj.weight": (d, 48),
        "layers.1.input_layernorm.weight": (d,), "layers.1.self_attn.q_proj.weight": (hq, d),
        "layers.1.self_attn.k_proj.weight": (hkv, d), "layers.1.self_attn.v_proj.weight": (hkv, d),
        "layers.1.self_attn.o_proj.weight": (d, hq), "layers.1.post_attention_layernorm.weight": (d,),
        "layers.1.mlp.gate_proj.weight": (48, d), "layers.1.mlp.up_proj.weight": (48, d),
        "layers.1.mlp.down_proj.weight": (d, 48),
    }
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    qkv = drafter.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(tensors["layers.0.self_attn.k_proj.weight"], qkv[hq:hq + hkv])


# Fields of speculators' SpeculatorModelConfig, Eagle3SpeculatorConfig and PEagleSpeculatorConfig, plus what vLLM's
# speculators loader requires (speculators_config.proposal_methods[0].speculative_tokens, verifier.name_or_path,
# transformer_layer_config as a dict) and what its P-EAGLE translator reads (mask_token_id).
SPECULATORS_FIELDS = {"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
                      "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
                      "norm_before_fc", "speculators_config"}
PROPOSAL_FIELDS = {"proposal_type", "speculative_tokens", "verifier_accept_k", "accept_tolerance"}
LAYER_FIELDS = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "hidden_act", "attention_bias", "tie_word_embeddings"}


@pytest.mark.parametrize("method,arch", [("eagle3", "Eagle3Speculator"), ("peagle", "PEagleSpeculator")])
def test_speculators_config_carries_every_required_field(tmp_path, method, arch):
    drafter = random_drafter(method, num_layers=2)
    save_drafter(drafter, tmp_path / "head")
    d = json.loads((tmp_path / "head" / "config.json").read_text())
    assert SPECULATORS_FIELDS <= set(d)
    assert (d["speculators_model_type"], d["architectures"]) == (method, [arch])
    assert (d["draft_vocab_size"], d["target_hidden_size"]) == (31, 32)
    assert d["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert d["norm_before_fc"] is False and isinstance(d["norm_before_residual"], bool)
    spec = d["speculators_config"]
    assert spec["algorithm"] == method and spec["default_proposal_method"] == "greedy"
    assert PROPOSAL_FIELDS <= set(spec["proposal_methods"][0])
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == drafter.config.num_speculative_tokens
    assert set(spec["verifier"]) == {"name_or_path", "architectures"}
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert ("mask_token_id" in d) == (method == "peagle")
    layer = d["transformer_layer_config"]
    assert LAYER_FIELDS <= set(layer) and layer["model_type"] in ("llama", "qwen3")
    # speculators turns this dict into a transformers config of its model_type; it must describe our layers.
    hf = transformers.AutoConfig.for_model(**layer)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (
        32, 2, 2, 8, 64)


def aws_checkpoint(drafter, out):
    """A head laid out as AWS publishes them, built by hand from the drafter's parameters."""
    lc = drafter.config.transformer_layer_config
    q, kv, inter = lc.num_attention_heads * lc.head_dim, lc.num_key_value_heads * lc.head_dim, lc.intermediate_size
    tensors = {}
    for name, t in drafter.state_dict().items():
        name = name.replace("layers.0.", "midlayer.")
        if "qkv_proj" in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                tensors[name.replace("qkv_proj", part)] = chunk.contiguous()
        elif "gate_up_proj" in name:
            for part, chunk in zip(("gate_proj", "up_proj"), t.split([inter, inter])):
                tensors[name.replace("gate_up_proj", part)] = chunk.contiguous()
        else:
            tensors[name] = t.reshape(1, 1, -1) if name == "mask_hidden" else t
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": drafter.config.num_layers, "vocab_size": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 500.0, "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32",
        "draft_vocab_size": 31, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                                                  "use_aux_hidden_state": True},
    }
    if drafter.mask_hidden is not None:
        config["ptd_token_id"] = drafter.config.mask_token_id
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_aws_style_head_imports_with_identical_outputs(tmp_path, method):
    drafter = random_drafter(method, num_layers=3)
    path = aws_checkpoint(drafter, tmp_path / "aws")
    assert read_config(path)[1] == "aws"
    loaded = load_drafter(path, tiny_target().config)
    cfg = loaded.config
    assert (cfg.method, cfg.num_layers, cfg.draft_vocab_size, cfg.aux_layer_ids) == (method, 3, 31, (1, 3, 5))
    assert cfg.mask_token_id == (1 if method == "peagle" else None)
    assert cfg.norm_before_residual is False
    assert_same_state(drafter, loaded)
    assert torch.equal(run(drafter), run(loaded))


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_export_import_round_trips(tmp_path, method):
    drafter = random_drafter(method, num_layers=2, norm_before_residual=True)
    save_drafter(drafter, tmp_path / "native")
    export_drafter(tmp_path / "native", tmp_path / "aws", "aws")
    export_drafter(tmp_path / "aws", tmp_path / "back", "speculators")
    original, aws, back = (read_checkpoint(tmp_path / p) for p in ("native", "aws", "back"))
    assert (aws.format, back.format) == ("aws", "speculators")
    assert "midlayer.hidden_norm.weight" in load_file(tmp_path / "aws" / "model.safetensors")
    for ckpt in (aws, back):
        assert sorted(ckpt.tensors) == sorted(original.tensors)
        assert all(torch.equal(ckpt.tensors[n], t) for n, t in original.tensors.items())
    # The HF-Llama-style config has no place for the target's identity; everything that runs the head survives.
    forgetful = dataclasses.replace(original.config, target_architecture=None, target_name_or_path=None)
    assert aws.config == forgetful and back.config == forgetful
    target = tiny_target().config
    assert torch.equal(run(load_drafter(tmp_path / "aws", target)), run(drafter))
    export_drafter(tmp_path / "native", tmp_path / "again", "speculators")
    assert read_checkpoint(tmp_path / "again").config == original.config


@pytest.mark.parametrize("change,field,expected,found", [
    (dict(hidden_size=48), "hidden_size", 48, 32),
    (dict(vocab_size=80), "vocab_size", 80, 64),
    (dict(num_hidden_layers=2), "aux_layer_ids", "ids in 0..2", [2, 3, 4]),
    (dict(family="qwen3", qk_norm=True), "family", "qwen3", "llama"),
])
def test_mismatched_target_is_refused(tmp_path, change, field, expected, found):
    save_drafter(random_drafter("peagle"), tmp_path / "head")
    target = dataclasses.replace(tiny_target().config, **change)
    with pytest.raises(DrafterMismatchError, match=f"{field} expected {expected}") as info:
        load_drafter(tmp_path / "head", target)
    assert (info.value.field, info.value.expected, info.value.found) == (field, expected, found)
    assert f"found {found}" in str(info.value)


def test_missing_aux_ids_take_the_targets_default(tmp_path):
    save_drafter(random_drafter("eagle3"), tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = None
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    assert read_config(tmp_path / "head")[0].aux_layer_ids is None
    target = dataclasses.replace(tiny_target().config, num_hidden_layers=12)
    assert load_drafter(tmp_path / "head", target).config.aux_layer_ids == (2, 6, 9)


def test_head_without_embedding_shares_the_targets(tmp_path):
    drafter = random_drafter("eagle3")
    save_drafter(drafter, tmp_path / "head")
    file = tmp_path / "head" / "model.safetensors"
    tensors = load_file(file)
    del tensors["embed_tokens.weight"]
    save_file(tensors, str(file))
    target = tiny_target()
    with pytest.raises(ValueError, match="carries no embed_tokens"):
        load_drafter(tmp_path / "head", target.config)
    loaded = load_drafter(tmp_path / "head", target.config, target=target)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(loaded.fc.weight, drafter.fc.weight)


@pytest.mark.parametrize("flag", ["norm_before_fc", "norm_output"])
def test_heads_with_unsupported_feature_norms_are_refused(tmp_path, flag):
    save_drafter(random_drafter("eagle3"), tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config[flag] = True
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=flag):
        load_drafter(tmp_path / "head", tiny_target().config)


def test_output_directory_is_replaced_only_with_force(tmp_path):
    drafter = random_drafter("eagle3")
    out = tmp_path / "head"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        save_drafter(drafter, out)
    assert (out / "notes.txt").exists()
    save_drafter(drafter, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["head"]  # no temporary directory left behind
    with pytest.raises(ValueError, match="overwrite its source"):
        export_drafter(out, out, "aws", force=True)


def test_a_directory_that_is_no_drafter_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_target().config.to_hf_dict()))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not a drafter checkpoint"):
        read_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_config(tmp_path / "missing")


def test_vocabulary_maps_are_left_out_only_for_the_whole_vocabulary(tmp_path):
    target = tiny_target()
    full = Drafter.for_target(target, "eagle3", seed=0)  # draft vocabulary = every target id
    for name, drafter in (("full", full), ("reduced", random_drafter("eagle3"))):
        save_drafter(drafter, tmp_path / name)
    export_drafter(tmp_path / "full", tmp_path / "full-aws", "aws")
    for name in ("full", "full-aws"):  # as speculators writes them, and as vLLM needs them
        assert not {"d2t", "t2d"} & set(load_file(tmp_path / name / "model.safetensors"))
        loaded = load_drafter(tmp_path / name, target.config)
        assert loaded.to_target_ids(torch.tensor([0, 5, 63])).tolist() == [0, 5, 63]
        assert_same_state(full, loaded)
    file = tmp_path / "reduced" / "model.safetensors"
    tensors = load_file(file)
    del tensors["d2t"], tensors["t2d"]
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="lacks d2t / t2d"):
        load_drafter(tmp_path / "reduced", target.config)


NEW_FIELDS = ("speculators_version", "fc_norm", "norm_output", "embed_requires_grad", "tie_word_embeddings", "dtype")


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_config_has_speculators_current_fields_and_both_spellings(tmp_path, method):
    drafter = random_drafter(method)
    save_drafter(drafter, tmp_path / "head")
    d = json.loads((tmp_path / "head" / "config.json").read_text())
    assert d["speculators_version"] == "0.9.0"
    assert (d["fc_norm"], d["norm_output"], d["norm_before_fc"], d["tie_word_embeddings"]) == (False,) * 4
    assert d["embed_requires_grad"] is True
    assert d["dtype"] == d["torch_dtype"] == "float32"
    layer = d["transformer_layer_config"]
    assert layer["dtype"] == layer["torch_dtype"] == "float32"
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0} and layer["rope_theta"] == 500.0


def test_heads_written_before_the_new_fields_still_load(tmp_path):
    drafter = random_drafter("peagle")
    save_drafter(drafter, tmp_path / "head")
    file = tmp_path / "head" / "config.json"
    d = json.loads(file.read_text())
    for key in NEW_FIELDS:
        del d[key]
    del d["transformer_layer_config"]["rope_parameters"], d["transformer_layer_config"]["dtype"]
    file.write_text(json.dumps(d))
    loaded = load_drafter(tmp_path / "head", tiny_target().config)
    assert loaded.config == drafter.config and torch.equal(run(loaded), run(drafter))


def test_a_transformers_5_layer_config_is_read(tmp_path):
    """speculators' own heads: rope_parameters only, and the dtype at the top level only."""
    drafter = random_drafter("eagle3")
    save_drafter(drafter, tmp_path / "head")
    file = tmp_path / "head" / "config.json"
    d = json.loads(file.read_text())
    layer = d["transformer_layer_config"]
    for key in ("rope_theta", "rope_scaling", "torch_dtype", "dtype"):
        del layer[key]
    del d["torch_dtype"]
    d["dtype"] = "bfloat16"
    file.write_text(json.dumps(d))
    lc = read_config(tmp_path / "head")[0].transformer_layer_config
    assert (lc.rope_theta, lc.rope_scaling, lc.torch_dtype) == (500.0, None, "bfloat16")


def test_a_local_target_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "models" / "target").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    drafter = random_drafter("eagle3")
    for name, given, written in (("local", "models/target", str(tmp_path / "models" / "target")),
                                 ("hub", "org/some-model", "org/some-model")):
        config = dataclasses.replace(drafter.config, target_name_or_path=given)
        head = Drafter(config, drafter.vocab)
        head.load_state_dict(drafter.state_dict())
        save_drafter(head, tmp_path / name)
        d = json.loads((tmp_path / name / "config.json").read_text())
        assert d["speculators_config"]["verifier"]["name_or_path"] == written
