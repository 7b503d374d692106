"""The models' attention backends on CUDA with sliding windows and sinks: VarlenAttention's flash kernel (its left
window, its logsumexp) against DenseAttention in fp32."""

from __future__ import annotations

import pytest
import torch

import peagle.models.attention as backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("window,with_sinks", [(0, False), (0, True), (1, True), (64, False), (64, True),
                                               (1000, True)])
def test_varlen_attention_window_sinks(window, with_sinks):
    seq_lens, num_kv_heads, group, head_dim = [100, 300, 37], 2, 4, 64
    gen = torch.Generator().manual_seed(window)
    q = torch.randn(sum(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    k, v = (torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen) for _ in range(2))
    sinks = torch.randn(num_kv_heads * group, generator=gen) * 3 if with_sinks else None
    q, k, v = (x.to(CUDA, torch.bfloat16) for x in (q, k, v))
    sinks = None if sinks is None else sinks.to(CUDA)
    out = backends.VarlenAttention(seq_lens, CUDA)(0, q, k, v, window=window, sinks=sinks)
    assert not backends._VARLEN_BROKEN  # the flash kernel ran
    want = backends.DenseAttention(seq_lens)(0, q.float(), k.float(), v.float(), window=window, sinks=sinks)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
