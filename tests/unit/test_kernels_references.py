"""The PyTorch references of the kernels against independent definitions, and the backend dispatch.

Paged attention is checked against plain causal attention over the contiguous sequences (sliding windows and sinks:
against transformers' GPT-OSS eager attention and a row-by-row definition), the draft batch against the
hand-written worked example of its docstring. The Triton kernels are compared with these references in
test_kernels_triton.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import peagle.kernels as kernels
from peagle.kernels import (
    expand_draft_batch_ref,
    gather_draft_features_ref,
    paged_attention_ref,
    store_kv_ref,
)
from peagle.engine.attention import AttentionMetadata, AttentionOptions, PagedAttention
from peagle.models.attention import DenseAttention, VarlenAttention

I32 = torch.int32


def test_store_kv_ref_writes_slots_and_skips_padding():
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)  # [T, Hkv, D]
    v = -k
    k_cache = torch.zeros(3, 4, 2, 4)  # [num_blocks, block_size, Hkv, D]
    v_cache = torch.zeros(3, 4, 2, 4)
    store_kv_ref(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    expected = torch.zeros(3, 4, 2, 4)
    expected[1, 1] = k[0]  # slot 5 = block 1, offset 1
    expected[0, 0] = k[2]
    assert torch.equal(k_cache, expected)
    assert torch.equal(v_cache, -expected)


def paged_copy(seq_lens, k, v, block_size=16, seed=0):
    """k/v of whole sequences stored into a paged cache through shuffled block tables."""
    max_blocks = max(math.ceil(n / block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    gen = torch.Generator().manual_seed(seed)
    block_tables = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), max_blocks).to(I32)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    request = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    slots = block_tables[request, positions // block_size].long() * block_size + positions % block_size
    k_cache = torch.zeros(num_blocks, block_size, *k.shape[1:])
    v_cache = torch.zeros_like(k_cache)
    store_kv_ref(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache, block_tables, positions


@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_ref_equals_causal_attention(group):
    seq_lens, num_kv_heads, head_dim = [7, 20, 33], 2, 16
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(sum(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache, block_tables, positions = paged_copy(seq_lens, k, v)
    qsl = torch.tensor([0, 7, 27, 60], dtype=I32)
    out = paged_attention_ref(q, k_cache, v_cache, block_tables, qsl, positions, head_dim**-0.5, max(seq_lens))
    torch.testing.assert_close(out, DenseAttention(seq_lens)(0, q, k, v), atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_is_causal_by_position_not_row_order():
    # Rows at shuffled, repeated positions each see exactly the keys up to their own position.
    seq_lens, head_dim = [12, 30], 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(42, 4, head_dim, generator=gen)
    k = torch.randn(42, 1, head_dim, generator=gen)
    v = torch.randn(42, 1, head_dim, generator=gen)
    dense = DenseAttention(seq_lens)(0, q, k, v)
    k_cache, v_cache, block_tables, positions = paged_copy(seq_lens, k, v)
    rows = torch.cat([torch.randint(0, 12, (5,), generator=gen), 12 + torch.randint(0, 30, (9,), generator=gen)])
    qsl = torch.tensor([0, 5, 14, 14], dtype=I32)  # the last request is padding: no rows
    block_tables = torch.cat([block_tables, torch.zeros_like(block_tables[:1])])
    out = paged_attention_ref(q[rows], k_cache, v_cache, block_tables, qsl, positions[rows], head_dim**-0.5, 9)
    torch.testing.assert_close(out, dense[rows], atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_checks_max_query_len_and_heads():
    q = torch.randn(3, 2, 16)
    cache = torch.randn(1, 16, 2, 16)
    args = (cache, cache, torch.zeros(1, 1, dtype=I32), torch.tensor([0, 3], dtype=I32), torch.arange(3), 0.25)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention_ref(q, *args, 2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_ref(q[:, :1], *args, 3)


# Sliding windows and sinks

def gpt_oss_eager(q, k, v, window, sinks):
    """transformers' GPT-OSS eager attention of one sequence, masked by its sliding-window mask function (window 0:
    causal): q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    i = torch.arange(q.shape[0])
    rule = sliding_window_causal_mask_function(window) if window else causal_mask_function
    allowed = rule(0, 0, i[:, None], i[None, :])  # [T, T]
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)[None, None]
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, *(x.transpose(0, 1)[None] for x in (q, k, v)), mask,
                                     scaling=q.shape[-1] ** -0.5)
    return out[0]  # [T, Hq, D]


def rowwise_attention(q, k, v, positions, window, sinks):
    """Row by row from the definition: the keys p - window < j <= p of one contiguous sequence, the softmax's
    output times 1 / (1 + exp(sink - lse)). q [T, Hq, D], k/v [S, Hkv, D] -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for t, p in enumerate(positions.tolist()):
        seen = slice(max(p - window + 1, 0) if window else 0, p + 1)
        for h in range(q.shape[1]):
            scores = k[seen, h // group] @ q[t, h] / math.sqrt(q.shape[-1])  # [keys]
            out[t, h] = scores.softmax(0) @ v[seen, h // group]
            if sinks is not None:
                out[t, h] /= 1 + torch.exp(sinks[h] - scores.logsumexp(0))
    return out


def random_qkv(seed, num_tokens, num_kv_heads, group, head_dim):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(num_kv_heads * group, generator=gen) * 2


@pytest.mark.parametrize("window", [0, 1, 4, 50])
@pytest.mark.parametrize("group", [1, 3])
def test_window_and_sinks_equal_gpt_oss_eager_attention(window, group):
    q, k, v, sinks = random_qkv(window + group, 11, 2, group, 16)
    want = gpt_oss_eager(q, k, v, window, sinks)
    torch.testing.assert_close(rowwise_attention(q, k, v, torch.arange(11), window, sinks), want)
    torch.testing.assert_close(DenseAttention()(0, q, k, v, window=window, sinks=sinks), want)
    k_cache, v_cache, block_tables, positions = paged_copy([11], k, v, block_size=4)
    out = paged_attention_ref(q, k_cache, v_cache, block_tables, torch.tensor([0, 11], dtype=I32), positions,
                              16**-0.5, 11, window=window, sinks=sinks)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("window,with_sinks", [(0, True), (5, False), (5, True), (40, True)])
def test_paged_attention_ref_window_sinks_by_rows_at_shuffled_positions(window, with_sinks):
    seq_lens, group = [12, 30], 2
    q, k, v, sinks = random_qkv(window, 42, 2, group, 32)
    sinks = sinks.to(torch.bfloat16) if with_sinks else None  # any float dtype, fp32 math
    k_cache, v_cache, block_tables, positions = paged_copy(seq_lens, k, v)
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([torch.randint(0, 12, (5,), generator=gen), 12 + torch.randint(0, 30, (9,), generator=gen)])
    qsl = torch.tensor([0, 5, 14], dtype=I32)
    out = paged_attention_ref(q[rows], k_cache, v_cache, block_tables, qsl, positions[rows], 32**-0.5, 9,
                              window=window, sinks=sinks)
    sinks = None if sinks is None else sinks.float()
    want = torch.cat([rowwise_attention(q[rows[:5]], k[:12], v[:12], positions[rows[:5]], window, sinks),
                      rowwise_attention(q[rows[5:]], k[12:], v[12:], positions[rows[5:]], window, sinks)])
    torch.testing.assert_close(out, want)


def test_paged_attention_ref_reads_no_key_outside_the_windows():
    # Every cached key below the window of a request's lowest row is NaN: nothing of it reaches the output.
    q, k, v, sinks = random_qkv(0, 30, 1, 4, 16)
    k_cache, v_cache, block_tables, positions = paged_copy([30], k, v, block_size=4)
    args = (block_tables, torch.tensor([0, 3], dtype=I32), torch.tensor([20, 29, 25]), 0.25, 3)
    want = paged_attention_ref(q[:3], k_cache, v_cache, *args, window=6, sinks=sinks)
    poisoned = [c.clone().index_fill_(0, block_tables[0, :3].long(), math.nan) for c in (k_cache, v_cache)]
    poisoned[0][block_tables[0, 3].long(), :3] = math.nan  # positions 12 .. 14; the lowest window starts at 15
    poisoned[1][block_tables[0, 3].long(), :3] = math.nan
    torch.testing.assert_close(paged_attention_ref(q[:3], *poisoned, *args, window=6, sinks=sinks), want)
    assert paged_attention_ref(q[:3], *poisoned, *args, window=7, sinks=sinks).isnan().any()


@pytest.mark.parametrize("window,with_sinks", [(0, False), (0, True), (3, False), (3, True)])
def test_dense_and_varlen_attention_equal_the_paged_reference(window, with_sinks):
    seq_lens, group = [7, 20, 9], 3
    q, k, v, sinks = random_qkv(5, sum(seq_lens), 2, group, 16)
    sinks = sinks if with_sinks else None
    k_cache, v_cache, block_tables, positions = paged_copy(seq_lens, k, v)
    qsl = torch.tensor([0, 7, 27, 36], dtype=I32)
    want = paged_attention_ref(q, k_cache, v_cache, block_tables, qsl, positions, 16**-0.5, 20, window=window,
                               sinks=sinks)
    dense = DenseAttention(seq_lens)(0, q, k, v, window=window, sinks=sinks)
    torch.testing.assert_close(dense, want, atol=1e-5, rtol=1e-5)
    varlen = VarlenAttention(seq_lens, "cpu")(0, q, k, v, window=window, sinks=sinks)
    torch.testing.assert_close(varlen, want, atol=1e-5, rtol=1e-5)


def test_dense_attention_with_a_mask_takes_sinks_not_a_window():
    q, k, v, sinks = random_qkv(2, 6, 1, 2, 16)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(DenseAttention(mask=mask)(0, q, k, v, sinks=sinks), gpt_oss_eager(q, k, v, 0, sinks))
    with pytest.raises(ValueError, match="window into the mask"):
        DenseAttention(mask=mask)(0, q, k, v, window=3)


def test_window_and_sinks_are_checked():
    q, k, v, sinks = random_qkv(2, 6, 1, 2, 16)
    with pytest.raises(ValueError, match="window must be"):
        DenseAttention()(0, q, k, v, window=-1)
    with pytest.raises(ValueError, match="sinks must be"):
        VarlenAttention([6], "cpu")(0, q, k, v, sinks=sinks[:1])
    cache = torch.zeros(1, 16, 1, 16)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=I32), torch.tensor([0, 6], dtype=I32), torch.arange(6), 0.25, 6)
    with pytest.raises(ValueError, match="window must be"):
        paged_attention_ref(*args, window=2.5)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention_ref(*args, sinks=sinks.repeat(2))


@pytest.mark.parametrize("rotary", [False, True])
def test_paged_attention_backend_passes_window_and_sinks(rotary):
    # The engine's backend on the CPU (the reference): a prefill of two prompts, one layer, against DenseAttention.
    seq_lens, block_size = [9, 14], 4
    q, k, v, sinks = random_qkv(7, 23, 2, 2, 16)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    block_tables = torch.tensor([[5, 1, 3, 0], [2, 6, 7, 4]], dtype=I32)
    request = torch.repeat_interleave(torch.arange(2), torch.tensor(seq_lens))
    slots = block_tables[request, positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(positions, slots, block_tables, torch.tensor([0, 9, 23], dtype=I32), 14)
    caches = [(torch.zeros(8, block_size, 2, 16), torch.zeros(8, block_size, 2, 16))]
    backend = PagedAttention(caches, meta, 16**-0.5, AttentionOptions(fused_merge=True, mixed_tiles=True))
    if rotary:
        gen = torch.Generator().manual_seed(0)
        cos, sin = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
        out = backend.rotary_attend(0, positions, q, k, v, SimpleNamespace(tables=lambda device: (cos, sin)),
                                    window=3, sinks=sinks)
        q, k = kernels.rotary_ref(positions, q, k, cos, sin)
    else:
        out = backend(0, q, k, v, window=3, sinks=sinks)
    torch.testing.assert_close(out, DenseAttention(seq_lens)(0, q, k, v, window=3, sinks=sinks))


def worked_example(num_mask_slots):
    """The inputs of draft_batch.py's worked example: three requests (verify with one rejection, prefill, padding)
    and one bucket-padding row; block_size 4, mask_token_id 9."""
    return dict(
        target_input_ids=torch.tensor([100, 101, 102, 300, 301, 0]),
        target_positions=torch.tensor([5, 6, 7, 0, 1, 0]),
        target_slot_mapping=torch.tensor([13, 14, 15, 4, 5, -1]),
        query_start_loc=torch.tensor([0, 3, 5, 5], dtype=I32),
        num_rejected=torch.tensor([1, 0, 0], dtype=I32),
        next_token_ids=torch.tensor([200, 400, 0]),
        block_tables=torch.tensor([[2, 3, 5], [1, 4, 0], [0, 0, 0]], dtype=I32),
        block_size=4,
        mask_token_id=9,
        num_mask_slots=num_mask_slots,
    )


def assert_batch(batch, **expected):
    for name, values in expected.items():
        assert getattr(batch, name).tolist() == values, name


def test_expand_draft_batch_ref_worked_example():
    assert_batch(
        expand_draft_batch_ref(**worked_example(num_mask_slots=2)),
        input_ids=[101, 200, 9, 9, 9, 301, 400, 9, 9, 9, 9, 9],
        positions=[5, 6, 7, 7, 8, 0, 1, 2, 3, 0, 1, 0],
        slot_mapping=[13, 14, -1, 15, 20, 4, 5, 6, 7, -1, -1, -1],
        hidden_index=[0, 1, 2, -1, -1, 3, 4, -1, -1, -1, -1, -1],
        query_start_loc=[0, 5, 9, 11],
        seq_lens=[9, 4, 0],
        sample_rows=[[1, 3, 4], [6, 7, 8], [9, 9, 10]],
    )


def test_expand_draft_batch_ref_without_mask_slots_is_the_eagle_shift():
    # EAGLE-3's first pass: no MASK rows, the draft batch has the target batch's rows.
    assert_batch(
        expand_draft_batch_ref(**worked_example(num_mask_slots=0)),
        input_ids=[101, 200, 9, 301, 400, 9],
        positions=[5, 6, 7, 0, 1, 0],
        slot_mapping=[13, 14, -1, 4, 5, -1],
        hidden_index=[0, 1, 2, 3, 4, -1],
        query_start_loc=[0, 3, 5, 5],
        seq_lens=[7, 2, 0],
        sample_rows=[[1], [4], [5]],
    )


def test_expand_draft_batch_ref_rejects_inconsistent_rejections():
    example = worked_example(num_mask_slots=2)
    example["num_rejected"] = torch.tensor([3, 0, 0], dtype=I32)  # all three rows of request 0 rejected
    with pytest.raises(ValueError, match="num_rejected"):
        expand_draft_batch_ref(**example)


def test_gather_draft_features_ref():
    aux = torch.arange(6.0).view(3, 2)
    out = gather_draft_features_ref(aux, torch.tensor([1, -1, 0, -1]), torch.tensor([7.0, 8.0]))
    assert out.tolist() == [[2.0, 3.0], [7.0, 8.0], [0.0, 1.0], [7.0, 8.0]]


def test_backend_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert not kernels.use_triton(cpu) and kernels.use_triton(cuda)
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    assert not kernels.use_triton(cpu) and not kernels.use_triton(cuda)
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    assert kernels.use_triton(cpu) and kernels.use_triton(cuda)
    monkeypatch.setenv(kernels.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        kernels.use_triton(cpu)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernels.triton_module("kv_cache", torch.device("cpu"))


def test_dispatch_routes_to_triton_only_when_forced(monkeypatch):
    calls = []
    fake = SimpleNamespace(store_kv=lambda *args: calls.append("triton"))
    monkeypatch.setattr(kernels, "triton_module", lambda name, device: fake)
    k = torch.ones(1, 1, 16)
    cache = torch.zeros(1, 4, 1, 16)
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    kernels.store_kv(k, k, cache, cache.clone(), torch.tensor([2]))
    assert calls == [] and torch.equal(cache[0, 2], k[0])  # the reference ran on the CPU
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    kernels.store_kv(k, k, cache, cache.clone(), torch.tensor([2]))
    assert calls == ["triton"]


def advance_worked_example():
    """The inputs of decode_inputs.py's worked example, and output buffers for them."""
    out = {name: torch.full((9,), -7, dtype=torch.long) for name in ("input_ids", "positions", "slot_mapping")}
    out["drafts"] = torch.full((3, 2), -7, dtype=torch.long)
    out["num_drafts"] = torch.zeros(3, dtype=torch.long)
    inputs = dict(packed=torch.tensor([[11, 12, 40, 2, 50, 51], [30, -1, -1, 0, 31, 32]]),
                  src=torch.tensor([1, 0, -1]), base=torch.tensor([6, 5, 0]),
                  block_tables=torch.tensor([[3, 5, 1], [2, 6, 4], [7, 7, 7]], dtype=torch.int32),
                  k_prev=2, k=2, block_size=4, scratch_block=7)
    return inputs, out


def test_advance_decode_inputs_ref_worked_example():
    from peagle.kernels import advance_decode_inputs_ref

    inputs, out = advance_worked_example()
    advance_decode_inputs_ref(**inputs, out=out)
    assert out["input_ids"].tolist() == [30, 31, 32, 40, 50, 51, 0, 0, 0]
    assert out["positions"].tolist() == [6, 7, 8, 7, 8, 9, 0, 1, 2]
    assert out["slot_mapping"].tolist() == [22, 23, 4, 27, 16, 17, 28, 29, 30]
    assert out["drafts"].tolist() == [[31, 32], [50, 51], [0, 0]] and out["num_drafts"].tolist() == [2, 2, 2]
