"""The Triton kernels on CUDA: equal to their PyTorch references (the unit tests' cases plus engine-sized ones) and
replayable from a CUDA graph. Their timing is a benchmark, not a test: scripts/device/kernel_timing.py."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import peagle.kernels as kernels
from peagle.kernels import draft_batch, kv_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The random case builders are the unit tests' own, so both tiers check the same inputs.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_kernels_triton as unit_cases  # noqa: E402

# The module itself: the package attribute of the same name is the dispatch function.
attention = importlib.import_module("peagle.kernels.paged_attention")
CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def to_cuda(inputs: dict) -> dict:
    return {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def engine_attention_batch(num_requests, query_len, context_len, *, dtype=torch.bfloat16, num_kv_heads=3, group=3,
                           head_dim=64, shuffle=False, seed=0):
    # The testbed model's attention shape (9 query heads, 3 KV heads, head_dim 64) at engine batch sizes.
    return to_cuda(unit_cases.make_attention_batch(
        seed, [query_len] * num_requests, [context_len] * num_requests, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, dtype=dtype, shuffle=shuffle, tail=0,
    ))


def assert_attention_close(batch, num_splits=None, fused_merge=None):
    out = attention.paged_attention(**batch, num_splits=num_splits, fused_merge=fused_merge)
    expected = kernels.paged_attention_ref(**batch)
    rows = int(batch["query_start_loc"][-1])
    tol = TOLERANCE[batch["q"].dtype]
    torch.testing.assert_close(out[:rows].float(), expected[:rows].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits,fused_merge", [(1, None), (3, False), (3, True), (None, False), (None, True)])
@pytest.mark.parametrize("case", sorted(unit_cases.ATTENTION_CASES))
def test_paged_attention_unit_cases(case, num_splits, fused_merge):
    query_lens, context_lens, num_kv_heads, group, head_dim, dtype, shuffle, tail = unit_cases.ATTENTION_CASES[case]
    batch = unit_cases.make_attention_batch(len(case), query_lens, context_lens, num_kv_heads=num_kv_heads,
                                            group=group, head_dim=head_dim, dtype=dtype, shuffle=shuffle, tail=tail)
    assert_attention_close(to_cuda(batch), num_splits, fused_merge)


@pytest.mark.parametrize("num_requests,query_len,context_len,shuffle", [
    (1, 1, 2048, False),  # decode, split KV
    (1, 8, 1500, False),  # verify
    (64, 1, 700, False),  # decode at batch 64: no split
    (16, 8, 1024, False),
    (8, 16, 900, True),  # drafter batch: 2K rows per request at scattered positions
    (2, 600, 600, False),  # prefill
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_engine_shapes(num_requests, query_len, context_len, shuffle, dtype):
    assert_attention_close(engine_attention_batch(num_requests, query_len, context_len, dtype=dtype, shuffle=shuffle))
    assert_attention_close(engine_attention_batch(num_requests, query_len, context_len, dtype=dtype, shuffle=shuffle),
                           fused_merge=True)


def test_fused_merge_replays_from_a_graph_with_new_inputs():
    """The splits merged by their last arrival (fused_merge): replayed 20 times from one CUDA graph over new inputs
    each time, every replay equals the reference, so the arrival counters are back at zero after each."""
    att = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in engine_attention_batch(2, 8, 1500).items()}
    call = lambda: attention.paged_attention(**att, num_splits=8, fused_merge=True)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in range(20):
        new = engine_attention_batch(2, 8, 1500, seed=seed + 3, shuffle=seed % 2 == 1)
        for name in ("q", "k_cache", "v_cache", "block_tables", "positions"):
            att[name].copy_(new[name])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), kernels.paged_attention_ref(**new).float(), atol=2e-2, rtol=2e-2)


def assert_window_sinks_close(cpu_batch, window, sinks, **options):
    # Against the reference on the clean cache, the kernel over a cache that is NaN wherever no row may look.
    poisoned, _ = unit_cases.poison_outside_windows(cpu_batch, window)
    batch, poisoned = to_cuda(cpu_batch), to_cuda(poisoned)
    sinks = None if sinks is None else sinks.to(CUDA)
    expected = kernels.paged_attention_ref(**batch, window=window, sinks=sinks)
    out = attention.paged_attention(**poisoned, window=window, sinks=sinks, **options)
    rows = int(batch["query_start_loc"][-1])
    tol = TOLERANCE[batch["q"].dtype]
    torch.testing.assert_close(out[:rows].float(), expected[:rows].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits,fused_merge", [(1, None), (3, False), (3, True), (None, True)])
@pytest.mark.parametrize("window,with_sinks", [(0, True), (5, True), (16, False), (1000, True)])
@pytest.mark.parametrize("case", sorted(unit_cases.ATTENTION_CASES))
def test_paged_attention_window_sinks_unit_cases(case, window, with_sinks, num_splits, fused_merge):
    query_lens, context_lens, num_kv_heads, group, head_dim, dtype, shuffle, tail = unit_cases.ATTENTION_CASES[case]
    batch = unit_cases.make_attention_batch(len(case), query_lens, context_lens, num_kv_heads=num_kv_heads,
                                            group=group, head_dim=head_dim, dtype=dtype, shuffle=shuffle, tail=tail)
    sinks = unit_cases.random_sinks(num_kv_heads * group, window) if with_sinks else None
    assert_window_sinks_close(batch, window, sinks, num_splits=num_splits, fused_merge=fused_merge)


@pytest.mark.parametrize("num_requests,query_len,context_len,window,shuffle", [
    (1, 1, 4096, 128, False),  # a local layer's decode over a long context: the split heuristic sees the window
    (1, 1, 4096, 512, False),
    (1, 8, 4096, 128, False),  # verify
    (32, 8, 2048, 128, False),
    (8, 16, 1500, 512, True),  # drafter batch at scattered positions: the tile's lowest window bounds the walk
    (2, 600, 600, 128, False),  # prefill
])
@pytest.mark.parametrize("num_splits,fused_merge", [(None, False), (None, True), (8, True)])
def test_paged_attention_engine_shapes_window_sinks(num_requests, query_len, context_len, window, shuffle,
                                                    num_splits, fused_merge):
    batch = unit_cases.make_attention_batch(0, [query_len] * num_requests, [context_len] * num_requests,
                                            num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16,
                                            shuffle=shuffle, tail=0)
    assert_window_sinks_close(batch, window, unit_cases.random_sinks(9, 1), num_splits=num_splits,
                              fused_merge=fused_merge)


def test_window_sinks_replay_from_a_graph_with_new_inputs():
    """A local layer with sinks, split and merged in the kernel, replayed from one CUDA graph: new inputs and new
    sink values each time, every replay equal to the reference."""
    att = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in engine_attention_batch(2, 8, 1500).items()}
    sinks = unit_cases.random_sinks(9, 0).to(CUDA)

    def call():
        return attention.paged_attention(**att, num_splits=4, fused_merge=True, window=128, sinks=sinks)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in range(10):
        new = engine_attention_batch(2, 8, 1500, seed=seed + 3, shuffle=seed % 2 == 1)
        for name in ("q", "k_cache", "v_cache", "block_tables", "positions"):
            att[name].copy_(new[name])
        sinks.copy_(unit_cases.random_sinks(9, seed + 1))
        graph.replay()
        torch.cuda.synchronize()
        want = kernels.paged_attention_ref(**new, window=128, sinks=sinks)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_paged_attention_head_dim_128_gqa4():
    assert_attention_close(engine_attention_batch(4, 8, 1000, num_kv_heads=8, group=4, head_dim=128))


@pytest.mark.parametrize("num_kv_heads,group,head_dim,window", [
    (1, 4, 256, 512),  # Gemma 3 270M: one KV head, 256-wide, its local window
    (16, 2, 256, 1024),  # Gemma 4 31B's local layers
    (4, 8, 512, 0),  # Gemma 4 31B's global layers: 512-wide heads, keys as values
])
@pytest.mark.parametrize("query_len", [1, 8, 300])
def test_paged_attention_gemma_wide_heads(num_kv_heads, group, head_dim, window, query_len):
    cpu_batch = unit_cases.make_attention_batch(0, [query_len] * 4, [1500] * 4, num_kv_heads=num_kv_heads,
                                                group=group, head_dim=head_dim, dtype=torch.bfloat16, shuffle=False,
                                                tail=0)
    if window:
        assert_window_sinks_close(cpu_batch, window, None)
    else:
        assert_attention_close(to_cuda(cpu_batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(dtype):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(300, 3, 64, generator=gen).to(dtype).to(CUDA)
    v = torch.randn(300, 3, 64, generator=gen).to(dtype).to(CUDA)
    slots = torch.randperm(64 * 16, generator=gen)[:300].to(CUDA)
    slots[::7] = -1
    k_cache = torch.randn(64, 16, 3, 64, device=CUDA, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_cache.store_kv(k, v, k_cache, v_cache, slots)
    kernels.store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("case", sorted(unit_cases.DRAFT_CASES))
def test_expand_draft_batch(case):
    kinds, num_mask_slots, tail, index_dtype = unit_cases.DRAFT_CASES[case]
    inputs = to_cuda(unit_cases.make_draft_inputs(len(case), kinds, num_mask_slots, tail, index_dtype))
    out = draft_batch.expand_draft_batch(**inputs)
    for name, got, want in zip(out._fields, out, kernels.expand_draft_batch_ref(**inputs)):
        assert torch.equal(got, want), name


def test_gather_draft_features():
    aux = torch.randn(64, 3 * 576, device=CUDA, dtype=torch.bfloat16)
    hidden_index = torch.randint(-1, 64, (200,), device=CUDA)
    mask_hidden = torch.randn(3 * 576, device=CUDA)
    out = draft_batch.gather_draft_features(aux, hidden_index, mask_hidden)
    assert torch.equal(out, kernels.gather_draft_features_ref(aux, hidden_index, mask_hidden))


def test_cuda_graph_replay_follows_new_inputs():
    # Capture once; then new contexts, positions and rejections written into the same buffers must be honoured.
    att = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in engine_attention_batch(4, 8, 300).items()}
    draft = to_cuda(unit_cases.make_draft_inputs(1, ["verify"] * 4, 7, 0, torch.int64))

    def step():
        return attention.paged_attention(**att), draft_batch.expand_draft_batch(**draft)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, drafts = step()

    new_att = engine_attention_batch(4, 8, 300, seed=2, shuffle=True)  # same shapes, new values
    new_draft = to_cuda(unit_cases.make_draft_inputs(2, ["verify"] * 4, 7, 0, torch.int64))
    for name in ("q", "k_cache", "v_cache", "block_tables", "positions"):
        att[name].copy_(new_att[name])
    for name in ("target_input_ids", "target_positions", "target_slot_mapping", "num_rejected", "next_token_ids",
                 "block_tables"):
        draft[name].copy_(new_draft[name])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), kernels.paged_attention_ref(**new_att).float(), atol=2e-2, rtol=2e-2)
    for name, got, want in zip(drafts._fields, drafts, kernels.expand_draft_batch_ref(**new_draft)):
        assert torch.equal(got, want), name
