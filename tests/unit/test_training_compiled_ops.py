"""The compiled element-wise steps for training: checked against their references, installed, guarded."""

from __future__ import annotations

import pytest
import torch

from peagle import kernels
from peagle.models import layers
from peagle.training import compiled_ops


@pytest.fixture
def clean_ops():
    yield
    compiled_ops.uninstall()


def test_install_compiles_checks_and_dispatches_every_op(clean_ops):
    # aot_eager: the same tracing and autograd split as inductor, without generating code (fast on the CPU).
    assert compiled_ops.install(torch.device("cpu"), backend="aot_eager") == list(compiled_ops.OPS)
    with torch.enable_grad():
        for name in compiled_ops.OPS:
            assert layers._op(name) is layers.TRAINING_OPS[name]
    with torch.no_grad():  # inference keeps the fused kernels' dispatch
        assert layers._op("rms_norm") is kernels.rms_norm
    compiled_ops.uninstall()
    with torch.enable_grad():
        assert layers._op("rms_norm") is kernels.rms_norm_ref


def test_a_wrong_or_failing_op_is_not_used(clean_ops):
    ref = kernels.silu_and_mul_ref
    assert compiled_ops.agrees("silu_and_mul", ref, torch.device("cpu"))
    assert not compiled_ops.agrees("silu_and_mul", lambda x: ref(x) * 1.01, torch.device("cpu"))

    def broken(*args):
        raise RuntimeError("no kernel for this input")

    guarded = compiled_ops._Guarded("silu_and_mul", broken)
    x = torch.randn(5, 8)
    assert torch.equal(guarded(x), ref(x)) and guarded.compiled is None  # fell back, and stays there


def test_training_gradients_with_the_installed_ops_equal_the_references(clean_ops, tiny_hf_checkpoint):
    from peagle.drafters.drafter import Drafter
    from peagle.models.attention import DenseAttention
    from peagle.models.loader import load_model, load_tokenizer

    path = tiny_hf_checkpoint("llama", num_layers=4)
    target = load_model(path, dtype="float32")
    drafter = Drafter.for_target(target, "peagle", 2, tokenizer=load_tokenizer(path), aux_layer_ids=(1, 2, 3))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    ids = torch.randint(6, 300, (24,), generator=gen)
    features = torch.randn(24, drafter.config.feature_size, generator=gen)

    def grads():
        drafter.zero_grad(set_to_none=True)
        out = drafter(ids, torch.arange(24), DenseAttention([24]), drafter.fc(features))
        drafter.compute_logits(out).logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    reference = grads()
    assert compiled_ops.install(torch.device("cpu"), backend="aot_eager")
    compiled = grads()
    assert compiled.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(compiled[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)  # fp32 rounding
