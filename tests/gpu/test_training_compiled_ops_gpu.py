"""On CUDA: the inductor-compiled element-wise steps for training agree with their references (both dtypes)."""

from __future__ import annotations

import pytest
import torch

from peagle.training import compiled_ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name", compiled_ops.OPS)
def test_compiled_op_agrees_with_its_reference_on_cuda(name):
    from peagle import kernels

    compiled = torch.compile(getattr(kernels, f"{name}_ref"), dynamic=True)
    assert compiled_ops.agrees(name, compiled, torch.device("cuda"))


def test_install_on_cuda_installs_every_op():
    try:
        assert compiled_ops.install(torch.device("cuda")) == list(compiled_ops.OPS)
    finally:
        compiled_ops.uninstall()
