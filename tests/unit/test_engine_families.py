"""End to end on the CPU for the mixture-of-experts and sliding-window families: the engine's greedy output equals a
from-scratch recomputation, and speculative greedy output equals plain greedy output, well past the window."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import greedy, make_llm, recompute_greedy
from test_kernels_triton import interpreted  # noqa: F401 (a fixture)
from safetensors.torch import save_file

from peagle.drafters import Drafter, load_drafter, save_drafter
from peagle.models.loader import load_model

# The tiny families' window is 6 tokens: prompts and answers run far past it.
PROMPTS = [[7, 20, 31, 40, 41, 42, 43, 44, 45], [9, 15], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [30]]
FAMILIES = ["qwen3_moe", "gpt_oss", "mistral_swa", "gemma3", "gemma4"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_target(request, tiny_hf_checkpoint):
    target = tiny_hf_checkpoint(request.param, num_layers=4)
    outs = make_llm(target).generate(PROMPTS, greedy(32), use_tqdm=False)
    return target, [o.token_ids for o in outs]


def test_plain_engine_equals_full_recompute(family_target):
    target, plain = family_target
    model = load_model(target, dtype="float32")
    ids = recompute_greedy(model, PROMPTS[2], 32)
    assert ids[len(PROMPTS[2]):] == plain[2]


@pytest.mark.parametrize("method,k", [("eagle3", 3), ("peagle", 7)])
def test_speculative_greedy_equals_plain_greedy(family_target, tmp_path, method, k):
    target, plain = family_target
    head = tmp_path / "head"
    save_drafter(Drafter.for_target(target, method, 2 if method == "peagle" else 1, seed=5), head)
    outs = make_llm(target, head, k=k, parallel=method == "peagle").generate(PROMPTS, greedy(32), use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    assert all(o.metrics.num_drafting_rounds > 0 for o in outs)


def test_aws_gpt_oss_head_layout_serves_losslessly(tiny_hf_checkpoint, tmp_path):
    """AWS's GPT-OSS P-EAGLE heads: HF-Llama layout, the whole target vocabulary with an identity d2t, ptd_token_id,
    the target's YaRN RoPE in the head's config."""
    target = tiny_hf_checkpoint("gpt_oss", num_layers=4)
    drafter = Drafter.for_target(target, "peagle", 2, seed=7)
    lc = drafter.config.transformer_layer_config
    q, kv, inter = lc.num_attention_heads * lc.head_dim, lc.num_key_value_heads * lc.head_dim, lc.intermediate_size
    tensors = {}
    for name, t in drafter.state_dict().items():
        name = name.replace("layers.0.", "midlayer.")
        if "qkv_proj" in name:
            tensors.update({name.replace("qkv_proj", p): c.contiguous() for p, c in zip(("q_proj", "k_proj", "v_proj"),
                                                                                       t.split([q, kv, kv]))})
        elif "gate_up_proj" in name:
            tensors.update({name.replace("gate_up_proj", p): c.contiguous() for p, c in zip(("gate_proj", "up_proj"),
                                                                                       t.split([inter, inter]))})
        elif name not in ("d2t", "t2d"):
            tensors[name] = t.reshape(1, 1, -1) if name == "mask_hidden" else t
    vocab = lc.vocab_size
    tensors["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": lc.hidden_size, "intermediate_size": inter, "num_attention_heads": lc.num_attention_heads,
              "num_key_value_heads": lc.num_key_value_heads, "head_dim": lc.head_dim, "num_hidden_layers": 2,
              "vocab_size": vocab, "draft_vocab_size": vocab, "rms_norm_eps": lc.rms_norm_eps,
              "rope_theta": lc.rope_theta, "rope_scaling": lc.rope_scaling, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "torch_dtype": "float32", "ptd_token_id": drafter.config.mask_token_id,
              "num_lookahead_tokens": 5, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    head = tmp_path / "aws"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(head / "model.safetensors"))
    loaded = load_drafter(head, load_model(target, dtype="float32").config)
    assert (loaded.config.method, loaded.config.aux_layer_ids, loaded.config.draft_vocab_size) == ("peagle", (1, 2, 3),
                                                                                                  vocab)
    assert loaded.config.transformer_layer_config.rope_scaling["rope_type"] == "yarn"
    plain = make_llm(target).generate(PROMPTS, greedy(24), use_tqdm=False)
    spec = make_llm(target, head, k=5, parallel=True).generate(PROMPTS, greedy(24), use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def check_fused_qk_norm_path(target, prompts, plain):
    # In the interpreter process: the Triton path, where q/k norms run inside the RoPE + KV-store kernel.
    import os

    os.environ["PEAGLE_KERNELS"] = "triton"
    outs = make_llm(target, enforce_eager=True).generate(prompts, greedy(12), use_tqdm=False)
    assert [o.token_ids for o in outs] == [p[:12] for p in plain]


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3"])
def test_triton_path_with_fused_qk_norm_equals_the_reference_path(tiny_hf_checkpoint, interpreted, family):
    """The engine's Triton kernels (run by Triton's interpreter) give the torch path's greedy output for the families
    with q/k norms, which the fused RoPE + KV-store kernel applies."""
    target = tiny_hf_checkpoint(family, num_layers=2)
    plain = [o.token_ids for o in make_llm(target, enforce_eager=True).generate(PROMPTS[:2], greedy(12),
                                                                                  use_tqdm=False)]
    interpreted(check_fused_qk_norm_path, target, PROMPTS[:2], plain)


def check_gemv_path(target, prompts, plain):
    # In the interpreter process: the Triton path with decode_gemv (the target's linear layers of decode-sized calls
    # through the GEMV kernel).
    import os

    from peagle import kernels

    os.environ["PEAGLE_KERNELS"] = "triton"
    llm = make_llm(target, enforce_eager=True, decode_gemv=True)
    assert any(isinstance(m, kernels.GemvLinear) for m in llm.engine.target.modules())
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert [o.token_ids for o in outs] == [p[:12] for p in plain]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_triton_path_with_gemv_linears_equals_the_reference_path(tiny_hf_checkpoint, interpreted, family):
    """decode_gemv on the mixture-of-experts families (routers, biased and sink-carrying attention projections)
    gives the torch path's greedy output."""
    target = tiny_hf_checkpoint(family, num_layers=2)
    plain = [o.token_ids for o in make_llm(target, enforce_eager=True).generate(PROMPTS[:2], greedy(12),
                                                                                  use_tqdm=False)]
    interpreted(check_gemv_path, target, PROMPTS[:2], plain)
