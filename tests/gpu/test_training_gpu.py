"""On CUDA, through the compiled FlexAttention kernel: a P-EAGLE training step with its shapes padded
(`--shape-multiple`: padding rows of MASK slots that see only one another, weight-0 charged elements, padded teacher
rows) gives the loss, gradients and per-depth counts of the unpadded step; and an EAGLE-3 step likewise."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.drafters.drafter import Drafter
from peagle.models.config import ModelConfig
from peagle.models.llama import LlamaModel
from peagle.training.data import Document, PackedSequence
from peagle.training.objectives import Eagle3Objective, PEagleObjective
from peagle.training.teacher import run_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "eos_token_id": 0}
K = 6


def padded_step_results(tmp_path, method: str, device: str, multiple: int = 256):
    """[(loss, total, correct, grads)] of one step without and with shape padding (fp32, fixed seeds)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    target = LlamaModel(ModelConfig.from_dir(tmp_path)).to(device).eval().requires_grad_(False)
    drafter = Drafter.for_target(target, method, 2 if method == "peagle" else 1, aux_layer_ids=(0, 1, 2),
                                 mask_token_id=3).to(device)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in drafter.parameters():
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen).to(device))
    gen = torch.Generator().manual_seed(2)
    docs = [Document(torch.randint(6, CONFIG["vocab_size"], (n,), generator=gen), torch.rand(n, generator=gen) < 0.8)
            for n in (700, 333, 420)]
    seq = PackedSequence.of(docs)
    results = []
    for m in (0, multiple):
        objective = (PEagleObjective(K, 0.8, 0.2, 1, 512, shape_multiple=m) if method == "peagle"
                     else Eagle3Objective(K, 512, shape_multiple=m))
        layout = objective.sample_layout(seq, torch.Generator().manual_seed(3))
        plan = objective.plan(seq, layout)
        teacher = run_target(target, seq, drafter.config.aux_layer_ids, device)
        drafter.zero_grad(set_to_none=True)
        stats = objective.backward(drafter, target, teacher, plan.to(device), plan.weight_sum)
        grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results.append((float(stats.loss), stats.total.cpu(), stats.correct.cpu(), grads,
                        [f.rows for f in plan.forwards]))
    return results


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_padded_step_equals_the_unpadded_one_on_cuda(tmp_path, method):
    (loss, total, correct, grads, _), (p_loss, p_total, p_correct, p_grads, rows) = padded_step_results(
        tmp_path, method, "cuda")
    if method == "peagle":
        assert all(r is not None and r % 256 == 0 for r in rows)
    assert p_loss == pytest.approx(loss, rel=1e-5)
    assert torch.equal(p_total, total) and torch.equal(p_correct, correct)
    assert grads.keys() == p_grads.keys()
    for name in grads:
        torch.testing.assert_close(p_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
