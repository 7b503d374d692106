"""peagle's model, loaded by load_model, against transformers loading the same saved checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model
from peagle.models.weights import SafetensorsCheckpoint, to_hf_state_dict

ATOL = 2e-5


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_reference(hf, ids: torch.Tensor, aux_layer_ids):
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    # hidden_states[i] is the residual stream entering decoder layer i.
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layer_ids], dim=-1)
    return out.logits[0], aux


def _peagle_forward(model, ids: torch.Tensor, aux_layer_ids, attn=None):
    positions = torch.arange(ids.numel())
    out = model(ids, positions, attn or DenseAttention(), aux_layer_ids=aux_layer_ids)
    return model.compute_logits(out.hidden), out.aux


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_logits_and_aux_match_transformers(tiny_hf_checkpoint, family):
    path = tiny_hf_checkpoint(family)
    model = load_model(path, dtype="fp32")
    hf = _hf_model(path)
    aux_ids = model.config.default_aux_layer_ids
    assert aux_ids == (2, 4, 5)
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 33):
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=gen)
        logits, aux = _peagle_forward(model, ids, aux_ids)
        ref_logits, ref_aux = _hf_reference(hf, ids, aux_ids)
        assert logits.dtype == torch.float32
        assert aux.shape == (length, 3 * model.config.hidden_size)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(aux, ref_aux, atol=ATOL, rtol=1e-5)


def test_llama3_rope_scaling_is_read(tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint("llama3"), dtype="fp32")
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert model.config.rope_theta == 500000.0


def test_sharded_checkpoint_loads_like_single_file(tiny_hf_checkpoint):
    sharded = tiny_hf_checkpoint("qwen2", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(SafetensorsCheckpoint(sharded).files) > 1
    a, b = load_model(sharded, dtype="fp32"), load_model(tiny_hf_checkpoint("qwen2"), dtype="fp32")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    ids = torch.arange(11) * 7
    torch.testing.assert_close(_peagle_forward(a, ids, (2,))[0], _hf_reference(_hf_model(sharded), ids, (2,))[0],
                               atol=ATOL, rtol=1e-5)


def test_tied_embeddings(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("llama", tie_word_embeddings=True)
    model = load_model(path, dtype="fp32")
    assert model.lm_head is None
    ids = torch.arange(9) * 3
    torch.testing.assert_close(_peagle_forward(model, ids, (2,))[0], _hf_reference(_hf_model(path), ids, (2,))[0],
                               atol=ATOL, rtol=1e-5)


def test_batch_of_sequences_equals_separate_runs(tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint("qwen3"), dtype="fp32")
    aux_ids = model.config.default_aux_layer_ids
    a, b = torch.arange(5, 18), torch.arange(40, 47)
    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(a.numel()), torch.arange(b.numel())])
    out = model(ids, positions, DenseAttention(seq_lens=[a.numel(), b.numel()]), aux_layer_ids=aux_ids)
    logits = model.compute_logits(out.hidden)
    la, xa = _peagle_forward(model, a, aux_ids)
    lb, xb = _peagle_forward(model, b, aux_ids)
    torch.testing.assert_close(logits, torch.cat([la, lb]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.aux, torch.cat([xa, xb]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, expected", [("bf16", torch.bfloat16), ("float16", torch.float16),
                                             (torch.float32, torch.float32)])
def test_dtype_spellings_and_frozen_eval_model(tiny_hf_checkpoint, dtype, expected):
    model = load_model(tiny_hf_checkpoint("llama"), dtype=dtype)
    assert not model.training
    assert all(p.dtype == expected and not p.requires_grad and p.device.type == "cpu" for p in model.parameters())


def test_unknown_dtype_is_refused(tiny_hf_checkpoint):
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model(tiny_hf_checkpoint("llama"), dtype="int8")


def test_to_hf_state_dict_round_trips_the_checkpoint(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("qwen2")
    model = load_model(path, dtype="fp32")
    ckpt = SafetensorsCheckpoint(path)
    hf = to_hf_state_dict(model.state_dict(), model.config)
    assert set(hf) == set(ckpt.file_of)
    for name, tensor in hf.items():
        assert torch.equal(tensor, ckpt.get(name)), name


def test_dense_attention_runs_on_a_fused_kernel():
    # The training teacher attends through DenseAttention: its inputs must be shaped for the flash kernel (4-D),
    # or PyTorch silently takes the math path (fp32 scores of every document). Flash alone must accept them.
    import math

    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, h, 16, generator=gen) for h in (4, 2, 2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = DenseAttention(seq_lens=[12, 18])(0, q, k, v)
    # Against the rule written out: causal within each document, GQA groups of 2.
    want = []
    for start, n in ((0, 12), (12, 18)):
        part = slice(start, start + n)
        kk, vv = k[part].repeat_interleave(2, 1), v[part].repeat_interleave(2, 1)
        scores = torch.einsum("thd,shd->hts", q[part], kk) / math.sqrt(16)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want.append(torch.einsum("hts,shd->thd", scores.softmax(-1), vv))
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-5, atol=1e-5)
