"""The drafter forward against a plain reference written here with explicit matmuls and softmax.

P-EAGLE: one pass over [context..., next token, MASK x (K-1)]; EAGLE-3: a chain of K passes, each fed its own argmax
and its own pre-norm output. Weights are randomised (norms too) so that a misplaced norm or residual cannot hide.
"""

from __future__ import annotations

import math

import pytest
import torch

from peagle.drafters import Drafter, DraftVocab
from peagle.models.attention import DenseAttention
from peagle.models.config import ModelConfig
from peagle.models.llama import LlamaModel

K = 5


def tiny_target(family: str = "llama") -> LlamaModel:
    torch.manual_seed(0)
    cfg = ModelConfig(family=family, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=500.0,
                      qk_norm=family == "qwen3", torch_dtype="float32")
    return LlamaModel(cfg)


def random_drafter(method: str, family: str = "llama", num_layers: int = 2, norm_before_residual: bool = False,
                   seed: int = 1) -> Drafter:
    target = tiny_target(family)
    vocab = DraftVocab.from_target_ids(range(3, 64, 2), target.config.vocab_size)  # 31 odd ids: d2t is not zero
    drafter = Drafter.for_target(target, method, num_layers, draft_vocab=vocab,
                                 mask_token_id=1 if method == "peagle" else None,
                                 norm_before_residual=norm_before_residual, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if "norm" in name else 0.3 * noise)
    return drafter.eval()


# ---- the reference ------------------------------------------------------------------------------------------------

def rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, pos, theta):
    # x: [T, H, D], rotate-half layout
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def causal_attention(q, k, v):
    # q: [T, H, D], k/v: [T, Hkv, D]; every key at or before the query
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def ref_layer(w, i, cfg, x_in, residual, pos):
    """One decoder layer: attention input `x_in` (already normed), residual stream `residual`."""
    p = f"layers.{i}."
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = w[p + "self_attn.qkv_proj.weight"]
    wq, wk, wv = qkv[: hq * d], qkv[hq * d: (hq + hkv) * d], qkv[(hq + hkv) * d:]
    q = (x_in @ wq.T).view(-1, hq, d)
    k = (x_in @ wk.T).view(-1, hkv, d)
    v = (x_in @ wv.T).view(-1, hkv, d)
    if cfg.qk_norm:
        q = rms(q, w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms(k, w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
    q, k = rotate(q, pos, cfg.rope_theta), rotate(k, pos, cfg.rope_theta)
    x = residual + causal_attention(q, k, v).reshape(len(pos), -1) @ w[p + "self_attn.o_proj.weight"].T
    h = rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate_up = w[p + "mlp.gate_up_proj.weight"]
    gate, up = gate_up[: cfg.intermediate_size], gate_up[cfg.intermediate_size:]
    return x + (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ w[p + "mlp.down_proj.weight"].T


def ref_forward(drafter, ids, pos, features):
    """(pre-norm output [T, d], logits [T, draft_vocab]) for one sequence, in float64."""
    w = {n: t.double() for n, t in drafter.state_dict().items()}
    cfg, eps = drafter.config.transformer_layer_config, drafter.config.transformer_layer_config.rms_norm_eps
    hidden = features @ w["fc.weight"].T
    return ref_from_hidden(drafter, w, cfg, eps, ids, pos, hidden)


def ref_from_hidden(drafter, w, cfg, eps, ids, pos, hidden):
    embeds = w["embed_tokens.weight"][ids]
    normed = rms(hidden, w["layers.0.hidden_norm.weight"], eps)
    residual = normed if drafter.config.norm_before_residual else hidden
    x_in = torch.cat([rms(embeds, w["layers.0.input_layernorm.weight"], eps), normed], dim=-1)
    x = ref_layer(w, 0, cfg, x_in, residual, pos)
    for i in range(1, drafter.config.num_layers):
        x = ref_layer(w, i, cfg, rms(x, w[f"layers.{i}.input_layernorm.weight"], eps), x, pos)
    logits = rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
    return x, logits


def to_target(drafter, draft_ids):
    ids = drafter.vocab.target_ids
    return ids[draft_ids]


class RecordingAttention(DenseAttention):
    def __init__(self, seq_lens):
        super().__init__(seq_lens)
        self.layers = []

    def __call__(self, layer_idx, q, k, v):
        self.layers.append(layer_idx)
        return super().__call__(layer_idx, q, k, v)


# ---- tests --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,norm_before_residual", [("llama", False), ("llama", True), ("qwen3", False)])
def test_peagle_single_pass_matches_reference(family, norm_before_residual):
    drafter = random_drafter("peagle", family, num_layers=3, norm_before_residual=norm_before_residual)
    cfg = drafter.config
    gen = torch.Generator().manual_seed(7)
    # Two requests in one flat batch: contexts of 6 and 3 real tokens (the last is the next token), each
    # followed by K-1 MASK slots whose feature is mask_hidden; positions continue the sequence.
    seqs = []
    for n, start in ((6, 11), (3, 0)):
        ids = torch.cat([torch.randint(0, 64, (n,), generator=gen), torch.full((K - 1,), cfg.mask_token_id)])
        feats = torch.cat([torch.randn(n, cfg.feature_size, generator=gen),
                           drafter.mask_hidden.detach().expand(K - 1, -1)])
        seqs.append((n, ids, torch.arange(start, start + n + K - 1), feats))
    attn = RecordingAttention([len(s[1]) for s in seqs])
    with torch.no_grad():
        hidden = drafter.fc(torch.cat([s[3] for s in seqs]))
        out = drafter(torch.cat([s[1] for s in seqs]), torch.cat([s[2] for s in seqs]), attn, hidden)
        logits = drafter.compute_logits(out)
    assert attn.layers == [0, 1, 2]
    assert logits.dtype == torch.float32 and logits.shape == (out.shape[0], cfg.draft_vocab_size)
    start = 0
    for n, ids, pos, feats in seqs:
        ref_out, ref_logits = ref_forward(drafter, ids, pos, feats.double())
        rows = slice(start, start + len(ids))
        torch.testing.assert_close(out[rows].double(), ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[rows].double(), ref_logits, atol=1e-4, rtol=1e-4)
        # The K drafts: the outputs at the next-token slot and at the K-1 MASK slots.
        drafts = drafter.to_target_ids(logits[rows][n - 1:].argmax(-1))
        assert drafts.tolist() == to_target(drafter, ref_logits[n - 1:].argmax(-1)).tolist()
        assert all(t % 2 == 1 for t in drafts.tolist())  # only draft-vocabulary ids come out
        start += len(ids)


def test_eagle3_chain_matches_reference():
    drafter = random_drafter("eagle3", num_layers=1, norm_before_residual=True)
    cfg = drafter.config
    gen = torch.Generator().manual_seed(3)
    n = 7
    ids = torch.randint(0, 64, (n,), generator=gen)
    feats = torch.randn(n, cfg.feature_size, generator=gen)
    pos0 = 5

    with torch.no_grad():  # the module: K passes, recomputing the whole (causal) sequence each time
        tokens, hidden = ids, drafter.fc(feats)
        drafts = []
        for step in range(K):
            pos = torch.arange(pos0, pos0 + len(tokens))
            out = drafter(tokens, pos, DenseAttention([len(tokens)]), hidden)
            drafts.append(int(drafter.to_target_ids(drafter.compute_logits(out[-1:]).argmax(-1))))
            tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
            hidden = torch.cat([hidden, out[-1:]])  # its own pre-norm output feeds the next pass

    w = {name: t.double() for name, t in drafter.state_dict().items()}
    lc = cfg.transformer_layer_config
    tokens, hidden, ref_drafts = ids, feats.double() @ w["fc.weight"].T, []
    for step in range(K):
        pos = torch.arange(pos0, pos0 + len(tokens))
        out, logits = ref_from_hidden(drafter, w, lc, lc.rms_norm_eps, tokens, pos, hidden)
        ref_drafts.append(int(to_target(drafter, logits[-1].argmax())))
        tokens = torch.cat([tokens, torch.tensor(ref_drafts[-1:])])
        hidden = torch.cat([hidden, out[-1:]])
    assert drafts == ref_drafts
    assert len(set(drafts)) > 1  # the chain really moves


def test_mask_token_and_mask_hidden_are_ordinary_inputs():
    """A MASK slot is the mask token's embedding row plus fc(mask_hidden): no special casing anywhere."""
    drafter = random_drafter("peagle")
    cfg = drafter.config
    assert drafter.mask_hidden.shape == (3 * cfg.target_hidden_size,)
    ids = torch.tensor([5, cfg.mask_token_id])
    with torch.no_grad():
        hidden = drafter.fc(torch.stack([torch.randn(cfg.feature_size), drafter.mask_hidden]))
        before = drafter(ids, torch.arange(2), DenseAttention([2]), hidden)[1].clone()
        drafter.embed_tokens.weight[cfg.mask_token_id] += 1.0
        after = drafter(ids, torch.arange(2), DenseAttention([2]), hidden)[1]
    assert not torch.allclose(before, after)
    assert random_drafter("eagle3").mask_hidden is None


def test_for_target_copies_target_shape_and_rows():
    target = tiny_target("qwen3")
    vocab = DraftVocab.from_target_ids([2, 9, 40], 64)
    drafter = Drafter.for_target(target, "peagle", 2, draft_vocab=vocab, mask_token_id=63, seed=0)
    lc, tc = drafter.config.transformer_layer_config, target.config
    assert (lc.family, lc.num_hidden_layers, lc.qk_norm) == ("qwen3", 2, True)
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "rope_theta", "vocab_size"):
        assert getattr(lc, field) == getattr(tc, field), field
    assert drafter.config.aux_layer_ids == (2, 3, 4)
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[[2, 9, 40]])
    assert drafter.to_target_ids(torch.tensor([0, 1, 2])).tolist() == [2, 9, 40]
    again = Drafter.for_target(target, "peagle", 2, draft_vocab=vocab, mask_token_id=63, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))


def test_for_target_refuses_bad_aux_ids_and_missing_mask_token():
    target = tiny_target()
    with pytest.raises(ValueError, match="aux layer ids \\[7\\]"):
        Drafter.for_target(target, "eagle3", aux_layer_ids=(1, 2, 7))
    with pytest.raises(ValueError, match="tokenizer"):
        Drafter.for_target(target, "peagle")  # no tokenizer to pick a reserved id from


def test_default_aux_layers_stay_inside_shallow_targets():
    def ids(n):
        return ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=n,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8).default_aux_layer_ids

    assert ids(32) == (2, 16, 29) and ids(30) == (2, 15, 27)  # EAGLE-3's choice for real depths
    # Distinct layers' inputs (0..n-1) from 3 layers on: vLLM taps inputs only and refuses a layer tapped twice.
    for n in range(3, 40):
        low, mid, high = ids(n)
        assert 0 <= low < mid < high < n, n
    assert ids(6) == (2, 3, 4) and ids(4) == (1, 2, 3) and ids(2) == (0, 1, 1) and ids(1) == (0, 0, 0)
    torch.manual_seed(0)
    shallow = LlamaModel(ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert Drafter.for_target(shallow, "eagle3").config.aux_layer_ids == (0, 1, 1)
