"""Every Triton kernel equals its PyTorch reference on random inputs, run by Triton's interpreter on the CPU.

The interpreter must be on before triton is first imported (triton's own library functions are decorated at import),
and other test modules import triton early (through transformers). So unless this process already interprets, each
check runs in one spawned worker process that turns TRITON_INTERPRET=1 on before importing anything.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

import peagle.kernels as kernels

CPU = torch.device("cpu")
I32 = torch.int32
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _interpreter_on() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


@pytest.fixture(scope="module")
def interpreted():
    """run(check, *args): call check(*args) where Triton's interpreter is on; its assertion errors come back."""
    if _interpreter_on():
        yield lambda check, *args: check(*args)
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        # Start the worker now, inheriting TRITON_INTERPRET=1; a builtin task imports nothing of ours (and no triton).
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TRITON_INTERPRET", "1")
            pool.submit(int).result()
        yield lambda check, *args: pool.submit(check, *args).result()


def triton_kernels(name):
    os.environ["TRITON_INTERPRET"] = "1"  # a no-op where the interpreter is on, which `interpreted` ensures
    return kernels.triton_module(name, CPU)


# store_kv

def check_store_kv(dtype, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_kv_heads, num_blocks, block_size = 7, 3, 4, 4
    # k and v as views of a fused projection output, not contiguous across heads.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.tensor([1, 4])] = -1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_kernels("kv_cache").store_kv(k, v, k_cache, v_cache, slots.to(I32))
    kernels.store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.bfloat16, 64)])
def test_store_kv(interpreted, dtype, head_dim):
    interpreted(check_store_kv, dtype, head_dim, 0)


# paged_attention

def make_attention_batch(seed, query_lens, context_lens, *, num_kv_heads, group, head_dim, dtype, shuffle, tail,
                         block_size=16):
    """A random paged cache holding each request's context in scattered blocks, and query rows for it.

    Request b has context_lens[b] cached positions; its query_lens[b] rows sit at the last positions in order, or,
    with `shuffle`, at random positions of the context, repeats allowed. `tail` rows belong to no request.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_request) + 2
    owner = torch.randperm(num_blocks, generator=gen).tolist()
    # Unused entries point at random blocks: the kernel must never read them.
    block_tables = torch.randint(0, num_blocks, (len(context_lens), max(blocks_per_request) + 1), generator=gen)
    for b, n in enumerate(blocks_per_request):
        block_tables[b, :n] = torch.tensor(owner[:n])
        owner = owner[n:]
    positions = [
        torch.randint(0, ctx, (n,), generator=gen) if shuffle else torch.arange(ctx - n, ctx)
        for n, ctx in zip(query_lens, context_lens)
    ]
    positions.append(torch.randint(0, 4, (tail,), generator=gen))
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        q=torch.randn(sum(query_lens) + tail, num_kv_heads * group, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        block_tables=block_tables.to(I32),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=I32),
        positions=torch.cat(positions),
        scale=head_dim**-0.5,
        max_query_len=max(max(query_lens), 1),
    )


ATTENTION_CASES = {
    # name: (query_lens, context_lens, num_kv_heads, group, head_dim, dtype, shuffle, tail)
    "decode_gqa3": ([1, 1, 1], [5, 40, 17], 3, 3, 64, torch.float32, False, 0),
    "verify_padding_request": ([4, 0, 3], [20, 10, 33], 2, 4, 32, torch.bfloat16, False, 2),
    "draft_shuffled_positions": ([6, 5], [9, 30], 2, 1, 16, torch.float32, True, 0),
    "prefill_multi_tile": ([40, 2], [40, 70], 1, 8, 16, torch.bfloat16, False, 0),
    "head_dim_128_fp16": ([7, 1, 0], [7, 65, 1], 1, 2, 128, torch.float16, True, 1),
    # contexts of several KV tiles: a window walks only its last one
    "long_context_decode_verify": ([1, 4], [300, 260], 2, 2, 32, torch.float32, False, 0),
}


def check_paged_attention(case, num_splits, fused_merge=False):
    query_lens, context_lens, num_kv_heads, group, head_dim, dtype, shuffle, tail = ATTENTION_CASES[case]
    batch = make_attention_batch(len(case), query_lens, context_lens, num_kv_heads=num_kv_heads, group=group,
                                 head_dim=head_dim, dtype=dtype, shuffle=shuffle, tail=tail)
    module = triton_kernels("paged_attention")
    expected = kernels.paged_attention_ref(**batch)
    rows = sum(query_lens)  # rows past the last request are left unwritten by the kernel
    tol = TOLERANCE[dtype]
    for _ in range(2 if fused_merge else 1):  # the split counters must be back at zero for the second call
        out = module.paged_attention(**batch, num_splits=num_splits, fused_merge=fused_merge)
        torch.testing.assert_close(out[:rows].float(), expected[:rows].float(), atol=tol, rtol=tol)
    if fused_merge and num_splits > 1:
        (counters,) = module._arrivals_buffers["cpu"]
        assert not counters.any()


@pytest.mark.parametrize("num_splits,fused_merge", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_attention(interpreted, case, num_splits, fused_merge):
    """Against the reference; split KV merged by the second kernel, or by the last split to arrive (fused)."""
    interpreted(check_paged_attention, case, num_splits, fused_merge)


MIXED_CASES = {
    # name: (query_lens, context_lens, num_kv_heads, group, head_dim, dtype, tail, small_query_len)
    "decodes_beside_a_prompt": ([8, 8, 40, 8, 3, 8], [30, 9, 40, 60, 17, 8], 3, 3, 64, torch.float32, 5, 8),
    "two_prompts_chunk_and_empty": ([1, 70, 0, 1, 33, 2], [20, 70, 5, 9, 50, 2], 2, 4, 32, torch.bfloat16, 0, 2),
    "plain_decodes_beside_a_prompt": ([1, 1, 19, 1], [5, 12, 19, 40], 1, 8, 16, torch.float32, 3, 1),
    # 12 rows x 8 heads do not fit a 64-pair tile (head_dim 128): 12-row requests go to the long launch
    "capped_small_tile": ([12, 3, 12, 30, 8], [12, 9, 40, 30, 20], 1, 8, 128, torch.float16, 0, 12),
}


def check_paged_attention_mixed_tiles(case, num_splits, fused_merge):
    query_lens, context_lens, num_kv_heads, group, head_dim, dtype, tail, small = MIXED_CASES[case]
    batch = make_attention_batch(len(case), query_lens, context_lens, num_kv_heads=num_kv_heads, group=group,
                                 head_dim=head_dim, dtype=dtype, shuffle=False, tail=tail)
    batch["max_query_len"] = sum(query_lens) + tail  # a mixed step's bucket: its whole token count
    module = triton_kernels("paged_attention")
    expected = kernels.paged_attention_ref(**batch)
    rows = sum(query_lens)
    tol = TOLERANCE[dtype]
    calls = []
    real = module._launch
    module._launch = lambda *a, **kw: calls.append(kw.get("map_mode", 0)) or real(*a, **kw)
    try:
        maps = {}
        for _ in range(2):  # the second call reuses the tile map kept in `maps`
            out = module.paged_attention(**batch, num_splits=num_splits, fused_merge=fused_merge,
                                         small_query_len=small, mixed_tiles=True, tile_maps=maps)
            torch.testing.assert_close(out[:rows].float(), expected[:rows].float(), atol=tol, rtol=tol)
        assert calls == [1, 2, 1, 2] and len(maps) == 1
        if module.MIXED_TILES:  # the default: the same two launches when mixed_tiles is not given
            calls.clear()
            module.paged_attention(**batch, num_splits=num_splits, small_query_len=small)
            assert calls == [1, 2]
        # off, or every request within one small tile (a decode round): one launch; a small tile capped below
        # max_query_len still splits
        calls.clear()
        module.paged_attention(**batch, num_splits=num_splits, small_query_len=small, mixed_tiles=False)
        module.paged_attention(**batch, num_splits=num_splits, small_query_len=batch["max_query_len"],
                               mixed_tiles=True)
        _, covered = module.query_tile(batch["max_query_len"], group, head_dim)
        assert calls == ([0, 0] if covered >= batch["max_query_len"] else [0, 1, 2])
    finally:
        module._launch = real


@pytest.mark.parametrize("num_splits,fused_merge", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("case", sorted(MIXED_CASES))
def test_paged_attention_mixed_tiles(interpreted, case, num_splits, fused_merge):
    """Short and long requests of a mixed step in two launches, against the reference."""
    interpreted(check_paged_attention_mixed_tiles, case, num_splits, fused_merge)


def poison_outside_windows(batch, window):
    """The batch with NaN in every cache slot that no request's rows may see (below the window of its lowest row,
    past its highest row), so that a kernel reading one returns NaN; and whether some request's lowest window starts
    past position 0 (full attention would read NaN)."""
    k_cache = batch["k_cache"]
    block_size = k_cache.shape[1]
    keep = torch.zeros(k_cache.shape[:2], dtype=torch.bool)  # [num_blocks, block_size]
    bounds = batch["query_start_loc"].tolist()
    below = False
    for req, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            pos = batch["positions"][start:end]
            lowest = max(int(pos.min()) - window + 1, 0) if window else 0
            below |= lowest > 0
            keys = torch.arange(lowest, int(pos.max()) + 1)
            keep[batch["block_tables"][req, keys // block_size].long(), keys % block_size] = True
    hidden = ~keep[:, :, None, None]
    return {**batch, "k_cache": k_cache.masked_fill(hidden, math.nan),
            "v_cache": batch["v_cache"].masked_fill(hidden, math.nan)}, below


def random_sinks(num_heads, seed):
    # bf16: any float dtype is read, in fp32; spread so that some rows give the sink most of their weight
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)


def check_paged_attention_window_sinks(case, window, with_sinks):
    query_lens, context_lens, num_kv_heads, group, head_dim, dtype, shuffle, tail = ATTENTION_CASES[case]
    batch = make_attention_batch(len(case), query_lens, context_lens, num_kv_heads=num_kv_heads, group=group,
                                 head_dim=head_dim, dtype=dtype, shuffle=shuffle, tail=tail)
    sinks = random_sinks(num_kv_heads * group, window) if with_sinks else None
    module = triton_kernels("paged_attention")
    expected = kernels.paged_attention_ref(**batch, window=window, sinks=sinks)
    poisoned, below = poison_outside_windows(batch, window)
    rows = sum(query_lens)
    tol = TOLERANCE[dtype]
    for num_splits, fused_merge in ((1, False), (3, False), (3, True)):
        out = module.paged_attention(**poisoned, num_splits=num_splits, fused_merge=fused_merge, window=window,
                                     sinks=sinks)
        torch.testing.assert_close(out[:rows].float(), expected[:rows].float(), atol=tol, rtol=tol)
    if below:  # the poison bites: without the window the kernel reads it (the interpreter warns of NaN rows)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert module.paged_attention(**poisoned, num_splits=1, sinks=sinks)[:rows].isnan().any()


@pytest.mark.parametrize("window,with_sinks", [(0, True), (5, False), (5, True), (16, False), (16, True),
                                               (1000, False), (1000, True)])
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_attention_window_sinks(interpreted, case, window, with_sinks):
    """Windows (smaller and larger than the contexts) and sinks against the reference, unsplit and split KV merged
    either way, over a cache that is NaN wherever no row may look: the kernel reads no key outside the windows."""
    interpreted(check_paged_attention_window_sinks, case, window, with_sinks)


def check_paged_attention_mixed_window_sinks(case):
    query_lens, context_lens, num_kv_heads, group, head_dim, dtype, tail, small = MIXED_CASES[case]
    batch = make_attention_batch(len(case), query_lens, context_lens, num_kv_heads=num_kv_heads, group=group,
                                 head_dim=head_dim, dtype=dtype, shuffle=False, tail=tail)
    batch["max_query_len"] = sum(query_lens) + tail
    sinks = random_sinks(num_kv_heads * group, len(case))
    module = triton_kernels("paged_attention")
    expected = kernels.paged_attention_ref(**batch, window=6, sinks=sinks)
    poisoned, _ = poison_outside_windows(batch, 6)
    rows = sum(query_lens)
    tol = TOLERANCE[dtype]
    for num_splits, fused_merge in ((1, False), (2, False), (2, True)):
        out = module.paged_attention(**poisoned, num_splits=num_splits, fused_merge=fused_merge, window=6,
                                     sinks=sinks, small_query_len=small, mixed_tiles=True)
        torch.testing.assert_close(out[:rows].float(), expected[:rows].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", sorted(MIXED_CASES))
def test_paged_attention_mixed_tiles_window_sinks(interpreted, case):
    """A mixed step's two launches with a window and sinks, over a cache poisoned outside the windows."""
    interpreted(check_paged_attention_mixed_window_sinks, case)


def test_mixed_tile_map_lists_the_long_requests_tiles():
    from peagle.kernels.paged_attention import mixed_tile_map, mixed_tiles_bound

    qsl = torch.tensor([0, 8, 48, 56, 57, 157], dtype=I32)  # rows 8, 40, 8, 1, 100
    bound = mixed_tiles_bound(157, 5, small_q=8, block_q=42)
    assert bound == 4 + 5
    got = mixed_tile_map(qsl, small_q=8, block_q=42, num_tiles=bound).tolist()
    # request 1 (40 rows): one tile; request 4 (100 rows): three, last first; then nothing
    assert got == [[1, 0], [4, 2], [4, 1], [4, 0]] + [[-1, 0]] * 5


def check_dispatch_when_forced():
    os.environ[kernels.BACKEND_ENV] = "triton"
    try:
        batch = make_attention_batch(0, [2, 1], [9, 20], num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
                                     shuffle=False, tail=0)
        torch.testing.assert_close(kernels.paged_attention(**batch), kernels.paged_attention_ref(**batch))
        sinks = random_sinks(4, 0)
        torch.testing.assert_close(kernels.paged_attention(**batch, window=3, sinks=sinks),
                                   kernels.paged_attention_ref(**batch, window=3, sinks=sinks))
    finally:
        del os.environ[kernels.BACKEND_ENV]


def test_dispatch_when_forced(interpreted):
    interpreted(check_dispatch_when_forced)


# expand_draft_batch and gather_draft_features

def make_draft_inputs(seed, kinds, num_mask_slots, tail, index_dtype):
    """A verified target batch; kinds[b] is "pad" (no rows), "prefill" (up to 300 rows) or "verify" (K + 1 rows,
    some rejected). Slots follow random block tables with room for the MASK positions."""
    gen = torch.Generator().manual_seed(seed)
    block_size, max_blocks = 4, 100

    def draw(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    ids, positions, slots, lens, rejected = [], [], [], [], []
    num_blocks = len(kinds) * max_blocks + 8
    block_tables = torch.randperm(num_blocks, generator=gen)[: len(kinds) * max_blocks].view(len(kinds), max_blocks)
    for b, kind in enumerate(kinds):
        n = {"pad": 0, "prefill": draw(1, 300), "verify": num_mask_slots + 2}[kind]
        start = draw(0, 40)
        pos = torch.arange(start, start + n)
        lens.append(n)
        rejected.append(draw(0, n) if kind == "verify" else 0)
        ids.append(torch.randint(10, 1000, (n,), generator=gen))
        positions.append(pos)
        slots.append(block_tables[b, pos // block_size] * block_size + pos % block_size)
    ids.append(torch.randint(10, 1000, (tail,), generator=gen))
    positions.append(torch.zeros(tail, dtype=torch.long))
    slots.append(torch.full((tail,), -1))
    return dict(
        target_input_ids=torch.cat(ids).to(index_dtype),
        target_positions=torch.cat(positions).to(index_dtype),
        target_slot_mapping=torch.cat(slots).to(index_dtype),
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32),
        num_rejected=torch.tensor(rejected, dtype=I32),
        next_token_ids=torch.randint(10, 1000, (len(kinds),), generator=gen),
        block_tables=block_tables.to(I32),
        block_size=block_size,
        mask_token_id=3,
        num_mask_slots=num_mask_slots,
    )


DRAFT_CASES = {
    # name: (kinds, num_mask_slots, tail rows, index dtype)
    "one_verify_k8": (["verify"], 7, 0, torch.int64),
    "mixed_with_padding": (["verify", "pad", "prefill", "verify"], 3, 2, torch.int32),
    "eagle3_first_pass": (["prefill", "verify", "pad"], 0, 1, torch.int64),
    "single_mask_slot": (["verify", "verify", "pad", "pad", "verify"], 1, 0, torch.int32),
}


def check_expand_draft_batch(case):
    kinds, num_mask_slots, tail, index_dtype = DRAFT_CASES[case]
    inputs = make_draft_inputs(len(case), kinds, num_mask_slots, tail, index_dtype)
    out = triton_kernels("draft_batch").expand_draft_batch(**inputs)
    expected = kernels.expand_draft_batch_ref(**inputs)
    for name, got, want in zip(expected._fields, out, expected):
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("case", sorted(DRAFT_CASES))
def test_expand_draft_batch(interpreted, case):
    interpreted(check_expand_draft_batch, case)


def check_gather_draft_features(dtype, num_features):
    gen = torch.Generator().manual_seed(num_features)
    aux = torch.randn(9, num_features, generator=gen).to(dtype)
    hidden_index = torch.randint(-1, 9, (13,), generator=gen)
    hidden_index[:2] = -1
    mask_hidden = torch.randn(num_features, generator=gen)  # fp32 parameter, cast to the features' dtype
    out = triton_kernels("draft_batch").gather_draft_features(aux, hidden_index, mask_hidden)
    assert torch.equal(out, kernels.gather_draft_features_ref(aux, hidden_index, mask_hidden))


@pytest.mark.parametrize("dtype,num_features", [(torch.float32, 24), (torch.bfloat16, 1100)])
def test_gather_draft_features(interpreted, dtype, num_features):
    interpreted(check_gather_draft_features, dtype, num_features)


# advance_decode_inputs

def check_advance_decode_inputs(k_prev, k, seed):
    gen = torch.Generator().manual_seed(seed)
    b_prev, b, bs, width, scratch = 6, 5, 4, 6, 20
    num_drafts = k_prev + 3  # more drafts than are fed
    packed = torch.randint(0, 500, (b_prev, (k_prev + 1) + 1 + num_drafts), generator=gen)
    packed[:, k_prev + 1] = torch.randint(0, k_prev + 1, (b_prev,), generator=gen)  # number accepted
    src = torch.randperm(b_prev, generator=gen)[:b]
    src[-1] = -1  # bucket padding
    base = torch.randint(0, 8, (b,), generator=gen)
    tables = torch.randint(0, scratch, (b, width), generator=gen).to(I32)
    outs = []
    for fn in (triton_kernels("decode_inputs").advance_decode_inputs, kernels.advance_decode_inputs_ref):
        out = {name: torch.full((b * (k + 1),), -7, dtype=torch.long)
               for name in ("input_ids", "positions", "slot_mapping")}
        out["drafts"], out["num_drafts"] = torch.full((b, k), -7, dtype=torch.long), torch.zeros(b, dtype=torch.long)
        fn(packed, src, base, tables, k_prev, k, bs, scratch, out)
        outs.append(out)
    for name in outs[0]:
        assert torch.equal(outs[0][name], outs[1][name]), name


@pytest.mark.parametrize("k_prev,k", [(0, 0), (3, 3), (7, 5)])
def test_advance_decode_inputs(interpreted, k_prev, k):
    interpreted(check_advance_decode_inputs, k_prev, k, 0)


# linear: the small-batch GEMV

def check_gemv(dtype, m, n, k, split_k, bias):
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = triton_kernels("gemv").gemv(x, w, b, split_k=split_k)
    ref = kernels.linear_ref(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,m,n,k,split_k,bias", [
    (torch.float32, 1, 40, 96, 1, False),  # N and K not multiples of the blocks
    (torch.float32, 8, 64, 300, 2, True),  # split-K with a short last slice
    (torch.bfloat16, 5, 96, 1100, None, True),  # the split chosen for the shape (4 slices)
    (torch.float16, 19, 33, 260, 3, False),  # more rows than one tile
])
def test_gemv(interpreted, dtype, m, n, k, split_k, bias):
    interpreted(check_gemv, dtype, m, n, k, split_k, bias)


def check_silu_and_mul_gemv(dtype, m, n, k, split_k):
    gen = torch.Generator().manual_seed(m * 5 + k)
    x = (torch.randn(m, 2 * k, generator=gen) * 2).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    gemv, fused = triton_kernels("gemv"), triton_kernels("fused")
    two_kernels = gemv.gemv(fused.silu_and_mul(x), w, split_k=split_k)
    one = gemv.gemv(x, w, split_k=split_k, silu_and_mul=True)
    assert one.shape == (m, n) and torch.equal(one, two_kernels)  # the same roundings and sums, bit for bit
    ref = kernels.linear_ref(kernels.silu_and_mul_ref(x.float()), w.float())
    torch.testing.assert_close(one.float(), ref, atol=4 * TOLERANCE[dtype], rtol=4 * TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,m,n,k,split_k", [
    (torch.float32, 1, 40, 96, 1),
    (torch.bfloat16, 8, 64, 300, 3),  # split-K, a short last slice, up's columns K past gate's
    (torch.bfloat16, 3, 33, 1100, None),
])
def test_silu_and_mul_gemv(interpreted, dtype, m, n, k, split_k):
    interpreted(check_silu_and_mul_gemv, dtype, m, n, k, split_k)


def check_rms_norm_gemv(dtype, m, n, k, split_k, add):
    gen = torch.Generator().manual_seed(m * 3 + k)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    res = torch.randn(m, k, generator=gen).to(dtype) if add else None
    nw = (1 + torch.randn(k, generator=gen) / 4).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    gemv, fused = triton_kernels("gemv"), triton_kernels("fused")
    if add:
        h, want_sum = fused.fused_add_rms_norm(x, res, nw, 1e-5)
    else:
        h, want_sum = fused.rms_norm(x, nw, 1e-5), None
    two_kernels = gemv.gemv(h, w, split_k=split_k)
    summed = None if res is None else torch.empty_like(x)
    y = gemv.gemv(x, w, split_k=split_k, norm=(nw, 1e-5), residual=res, summed=summed)
    assert y.shape == (m, n) and y.dtype == dtype
    if add:
        assert torch.equal(summed, want_sum)  # the stream: an element-wise sum, rounded alike
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), two_kernels.float(), atol=2 * tol, rtol=2 * tol)
    ref_h = (kernels.fused_add_rms_norm_ref(x.float(), res.float(), nw.float(), 1e-5)[0] if add
             else kernels.rms_norm_ref(x.float(), nw.float(), 1e-5))
    torch.testing.assert_close(y.float(), kernels.linear_ref(ref_h, w.float()), atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("dtype,m,n,k,split_k,add", [
    (torch.float32, 1, 40, 96, 1, False),
    (torch.float32, 8, 64, 300, 3, True),  # split-K: every slice writes its part of the sum
    (torch.bfloat16, 3, 33, 1100, None, True),
    (torch.bfloat16, 5, 96, 200, 1, False),
])
def test_rms_norm_gemv(interpreted, dtype, m, n, k, split_k, add):
    interpreted(check_rms_norm_gemv, dtype, m, n, k, split_k, add)


def check_model_with_norms_and_activation_inside_the_gemv(family):
    # A decode-sized forward (8 tokens) of the whole model with GemvLinear projections: every norm but the last
    # and the MLP's activation run inside the GEMVs. The hidden state and the aux streams (the drafter's input)
    # match the plain forward's; the aux streams are the fused kernels' own sums, bit for bit the add's.
    from peagle.models.attention import DenseAttention
    from peagle.models.config import ModelConfig
    from peagle.models.llama import LlamaModel

    torch.manual_seed(0)
    cfg = ModelConfig(family=family, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=family == "qwen2",
                      torch_dtype="float32")
    model = LlamaModel(cfg).eval()
    ids, pos = torch.randint(0, 64, (8,)), torch.arange(8)
    os.environ[kernels.BACKEND_ENV] = "triton"
    try:
        with torch.inference_mode():
            want = model(ids, pos, DenseAttention(), aux_layer_ids=(0, 1, 3))
            kernels.use_gemv_linears(model)
            calls = []
            real = kernels.rms_norm_linear
            kernels.rms_norm_linear = lambda x, r, *a: calls.append(r is None) or real(x, r, *a)
            try:
                got = model(ids, pos, DenseAttention(), aux_layer_ids=(0, 1, 3))
            finally:
                kernels.rms_norm_linear = real
    finally:
        del os.environ[kernels.BACKEND_ENV]
    assert calls == [True] + [False] * 5  # the first layer's input norm has no residual to add
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.aux, want.aux, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_model_with_norms_and_activation_inside_the_gemv(interpreted, family):
    interpreted(check_model_with_norms_and_activation_inside_the_gemv, family)


def test_mlp_hands_its_gemv_down_projection_the_activation():
    """With GemvLinear projections (decode_gemv) a decode-sized MLP call runs silu_and_mul_linear, one kernel
    fewer, and answers as the plain MLP; larger batches and autograd take the plain path."""
    from peagle.models.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(16, 24)
    x, big = torch.randn(5, 16), torch.randn(12, 16)
    with torch.inference_mode():
        want, want_big = mlp(x), mlp(big)
    kernels.use_gemv_linears(mlp)
    calls = []
    real = kernels.silu_and_mul_linear
    try:
        kernels.silu_and_mul_linear = lambda h, *a: calls.append(h.shape) or real(h, *a)
        with torch.inference_mode():
            torch.testing.assert_close(mlp(x), want)
            torch.testing.assert_close(mlp(big), want_big)
        torch.testing.assert_close(mlp(x), want)  # autograd on
    finally:
        kernels.silu_and_mul_linear = real
    assert calls == [(5, 48)]


def test_gemv_split_k_choice_follows_the_h200_timing(monkeypatch):
    """The split chosen per projection where it was timed (BENCHMARKS.md run 8, 132 SMs): one slice for the
    testbed's K = 576 projections, several for K = 1536 and the 8B shape's (the winners of that table)."""
    gemv = triton_kernels("gemv")
    monkeypatch.setattr(gemv, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    testbed = {(960, 576): 1, (576, 576): 1, (3072, 576): 1, (576, 1536): 6}
    llama8b = {(6144, 4096): 2, (4096, 4096): 3, (28672, 4096): 1, (4096, 14336): 3}
    assert {nk: gemv.choose_split_k(*nk, cuda) for nk in {**testbed, **llama8b}} == {**testbed, **llama8b}
    assert gemv.choose_split_k(576, 1536, torch.device("cpu")) == 1  # 8 "SMs" off the GPU: 18 programs suffice


def test_gemv_tiling_follows_the_cold_h200_sweep(monkeypatch):
    """Tiles where they were timed with the weights out of L2 (BENCHMARKS.md run 16): the testbed's K = 576
    projections in one slice of 16 x 256 tiles, K = 1536 and the 8B shape's as choose_split_k splits them."""
    gemv = triton_kernels("gemv")
    monkeypatch.setattr(gemv, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    want = {(960, 576): (16, 256, 1), (576, 576): (16, 256, 1), (3072, 576): (16, 256, 1),
            (576, 1536): (32, 128, 6), (6144, 4096): (32, 128, 2), (4096, 14336): (32, 128, 3)}
    assert {nk: gemv.choose_tiling(*nk, cuda) for nk in want} == want


def check_gemv_tiling_choices(seed):
    # Whatever the tiling (chosen, or given in part), the GEMV equals the fp32 product in fp32.
    gemv = triton_kernels("gemv")
    gen = torch.Generator().manual_seed(seed)
    for n, k in ((40, 200), (24, 1100)):  # a short reduction (16 x 256 tiles) and a split one
        x, w = torch.randn(3, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
        want = x @ w.T
        # {} at K = 200 and block_k 2048: one tile a program (ONE_TILE: no read ahead); block_k 1024 at K = 1100: two
        for kw in ({}, {"block_n": 32}, {"block_k": 64}, {"split_k": 2}, {"block_n": 16, "block_k": 128},
                   {"block_k": 1024}, {"block_k": 2048}):
            torch.testing.assert_close(gemv.gemv(x, w, **kw), want, rtol=1e-5, atol=1e-5, msg=str((n, k, kw)))


def test_gemv_tiling_choices(interpreted):
    interpreted(check_gemv_tiling_choices, 0)


def test_gemv_norm_reads_a_decode_row_in_one_tile():
    """The norm inside the GEMV reads the testbed's rows (K = 576) in one tile, the 8B shape's (4096) in four."""
    from peagle.kernels.gemv import NORM_TILE_MAX, norm_block

    assert norm_block(576) == 1024 and norm_block(96) == 128
    assert norm_block(4096) == NORM_TILE_MAX == 1024


def test_gemv_linear_dispatch():
    """GemvLinear keeps nn.Linear's parameters and answers; it takes the kernel path only for small batches."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8, bias=False))
    x = torch.randn(3, 16)
    want = model(x)
    assert kernels.use_gemv_linears(model) == 2 and isinstance(model[0], kernels.GemvLinear)
    calls = []
    real = kernels.linear
    try:
        kernels.linear = lambda *a: calls.append(a[0].shape[0]) or real(*a)
        with torch.inference_mode():
            torch.testing.assert_close(model(x), want)
            model(torch.randn(9, 16))
        torch.testing.assert_close(model(x), want)  # autograd on: nn.Linear's forward
    finally:
        kernels.linear = real
    assert calls == [3, 3]


# The whole engine on the Triton kernels

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "eos_token_id": 0}


def sharpen_attention(model):
    """Random weights at the usual init scale give near-uniform attention, blind to where keys were written: scale
    the q and k projections so that the tokens depend on every key's position and value."""
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            attn.qkv_proj.weight[: attn.q_size + attn.kv_size] *= 30.0


def check_engine_on_triton_kernels(model_dir):
    # Every kernel of a decoding step (fused norms, RoPE with the KV-cache write, paged attention, the draft batch
    # expansion) against the references, end to end: the same tokens, with and without parallel drafting.
    from peagle import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40] * 20]
    spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3, "parallel_drafting": True}
    tokens = {}
    for backend in ("torch", "triton"):
        os.environ[kernels.BACKEND_ENV] = backend
        try:
            for name, speculative in (("plain", None), ("peagle", spec)):
                llm = LLM(model=model_dir, load_format="dummy", dtype="float32", device="cpu", max_model_len=256,
                          max_num_seqs=4, speculative_config=speculative)
                sharpen_attention(llm.engine.target)
                tokens[backend, name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            del os.environ[kernels.BACKEND_ENV]
    # Async scheduling (inputs advanced on the device) and the small-batch GEMV for the target's linear layers.
    os.environ[kernels.BACKEND_ENV] = "triton"
    try:
        llm = LLM(model=model_dir, load_format="dummy", dtype="float32", device="cpu", max_model_len=256,
                  max_num_seqs=4, speculative_config=spec, async_scheduling=True, decode_gemv=True)
        sharpen_attention(llm.engine.target)
        assert isinstance(llm.engine.target.layers[0].mlp.down_proj, kernels.GemvLinear)
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        tokens["triton", "async-gemv"] = [o.token_ids for o in llm.generate(prompts[:1], short, use_tqdm=False)]
    finally:
        del os.environ[kernels.BACKEND_ENV]
    assert tokens["triton", "plain"] == tokens["torch", "plain"]
    assert tokens["triton", "peagle"] == tokens["torch", "peagle"] == tokens["torch", "plain"]
    assert tokens["triton", "async-gemv"] == [tokens["torch", "plain"][0][:4]]


def check_engine_with_mixed_tiles(model_dir):
    # Steps that prefill a prompt beside decoding requests (more prompts than max_num_seqs, answers of different
    # lengths), their attention in two launches (MIXED_TILES): the tokens of the references.
    from peagle import LLM, SamplingParams

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40] * 20, [7] * 11, [3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3, "parallel_drafting": True}
    tokens = {}
    module = triton_kernels("paged_attention")
    real, maps, default = module._launch, [], module.MIXED_TILES
    module._launch = lambda *a, **kw: maps.append(kw.get("map_mode", 0)) or real(*a, **kw)
    module.MIXED_TILES = True
    try:
        for backend in ("torch", "triton"):
            os.environ[kernels.BACKEND_ENV] = backend
            try:
                llm = LLM(model=model_dir, load_format="dummy", dtype="float32", device="cpu", max_model_len=256,
                          max_num_seqs=2, speculative_config=spec)
                sharpen_attention(llm.engine.target)
                tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            finally:
                del os.environ[kernels.BACKEND_ENV]
    finally:
        module._launch, module.MIXED_TILES = real, default
    assert tokens["triton"] == tokens["torch"]
    assert 2 in maps and 1 in maps  # steps mixed prompts with decodes, tiled apart


def test_engine_with_mixed_tiles(interpreted, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    interpreted(check_engine_with_mixed_tiles, str(tmp_path))


def test_engine_on_triton_kernels(interpreted, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    interpreted(check_engine_on_triton_kernels, str(tmp_path))
