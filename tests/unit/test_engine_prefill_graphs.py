"""General-step CUDA graphs on the CPU: the padding to a (token bucket, request bucket, K) key and its bookkeeping.

There are no CUDA graphs here: `LLMEngine.general_graphs(capture=False)` runs the graphs' functions eagerly over
the same padded static buffers, so greedy output with the padding on must equal the output with it off, token for
token, and the padding must write only the scratch KV block. The Triton paged attention kernel (interpreted) gives a
padded batch's real rows at the bucket's max_query_len what it gives them unpadded. Graph capture itself:
tests/gpu/test_prefill_graphs_gpu.py.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from engine_helpers import cpu_llm, save_heads, spec_config, target_dir  # noqa: F401 (a fixture)
from test_kernels_triton import (TINY_LLAMA, interpreted, make_attention_batch,  # noqa: F401 (a fixture)
                                 sharpen_attention, triton_kernels)

import peagle.kernels as kernels

from peagle import LLM, SamplingParams
from peagle.engine import cuda_graph
from peagle.engine.config import EngineConfig
from peagle.engine.cuda_graph import request_buckets, token_buckets
from peagle.engine.model_runner import ModelRunner

# The last prompt is longer than a chunked step's budget, so its prefill runs in chunks in every configuration.
PROMPTS = [[7, 20, 31, 40], [9, 15], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30], [50, 60, 70],
           list(range(100, 135))]
# Up to 4 requests a step: 3 of them take request bucket 4 (one empty padding request).
ENGINE = {"max_num_seqs": 4}
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 24}


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory):
    return {None: None, **save_heads(target_dir, tmp_path_factory)}


def make_llm(target_dir, head, method, padded: bool, **kw):
    kw.setdefault("async_scheduling", False)  # the variants ask for async scheduling where they test it
    llm = cpu_llm(target_dir, spec_config(head, 3, method == "peagle"), **ENGINE, **kw)
    if padded:
        llm.engine.runner.general_graphs = llm.engine.general_graphs(capture=False)
    return llm


def params():
    # Different lengths, so requests finish at different steps and new prompts prefill beside running decodes.
    return [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(PROMPTS))]


def record_padded_steps(runner) -> list[dict]:
    """Each step that went through the general graphs: its key, real tokens, and per request (uncomputed tokens,
    computed tokens) at launch."""
    steps, launched = [], {}
    real_launch, real_pad = runner.launch, runner.pad_inputs

    def launch(seqs, drafts, st, plan, chunks=None):
        launched["reqs"] = [(s.num_tokens - s.num_computed_tokens, s.num_computed_tokens) for s in seqs]
        return real_launch(seqs, drafts, st, plan, chunks)

    def pad_inputs(inp, t, b):
        steps.append({"t": t, "b": b, "tokens": len(inp.input_ids), "reqs": launched["reqs"]})
        return real_pad(inp, t, b)

    runner.launch, runner.pad_inputs = launch, pad_inputs
    return steps


@pytest.mark.parametrize("method", [None, "eagle3", "peagle"])
@pytest.mark.parametrize("variant", ["plain", "chunked", "async"])
def test_padded_general_steps_keep_greedy_output(target_dir, heads, method, variant):
    kw = {"plain": {}, "chunked": CHUNKED, "async": {"async_scheduling": True}}[variant]
    ref = make_llm(target_dir, heads[method], method, padded=False, **kw).generate(PROMPTS, params(), use_tqdm=False)
    llm = make_llm(target_dir, heads[method], method, padded=True, **kw)
    steps = record_padded_steps(llm.engine.runner)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    prefill = [s for s in steps if any(n > 1 and c == 0 for n, c in s["reqs"])]
    assert any(len(s["reqs"]) > 1 and any(n == 1 for n, _ in s["reqs"]) for s in prefill), "no mixed step"
    assert any(s["tokens"] < s["t"] for s in steps)
    if variant != "async":  # there, decodes launch ahead without these graphs: every general step admits 4
        assert any(len(s["reqs"]) < s["b"] for s in steps), "no padding request"
    if variant == "chunked":  # a chunk after the first: a prefill over tokens already computed
        assert any(n > 1 and c > 0 for s in steps for n, c in s["reqs"])
    if method is not None:
        assert all(o.metrics.num_drafting_rounds > 0 for o in outs)


@pytest.mark.parametrize("method", [None, "peagle", "eagle3"])
def test_padding_writes_only_the_scratch_block(target_dir, heads, method):
    """Step a padded and an unpadded engine side by side over caches filled with NaN: the blocks of requests hold
    the same KV after every step, no block outside them is ever written except the scratch block, which the
    padding did write."""
    engines = [make_llm(target_dir, heads[method], method, padded=p, num_kv_blocks=64, **CHUNKED).engine
               for p in (False, True)]
    caches = [_caches(e.runner) for e in engines]
    for cache in caches:
        for t in cache:
            t.fill_(float("nan"))
    for engine in engines:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params())):
            engine.add_request(str(i), prompt, p)
    owned: set[int] = set()
    manager = engines[1].scheduler.block_manager
    real_allocate = manager.allocate

    def allocate(seq, num_tokens):
        real_allocate(seq, num_tokens)
        owned.update(seq.block_table)

    manager.allocate = allocate
    scratch = engines[1].runner.scratch_block
    while engines[0].has_unfinished_requests():
        for engine in engines:
            engine.step()
        blocks = sorted(owned)
        for a, b in zip(*caches):
            torch.testing.assert_close(b[blocks], a[blocks], equal_nan=True, rtol=1e-4, atol=1e-5)
    assert not engines[1].has_unfinished_requests()
    never = [b for b in range(scratch) if b not in owned]
    assert never, "every block was used: nothing checks stray writes"
    for t in caches[1]:
        assert t[never].isnan().all()
    assert not caches[1][0][scratch].isnan().all()  # the padding tokens' target keys went there


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_padding_rows_of_the_features_are_never_read(target_dir, heads, method):
    """Attention never writes the padding tokens' rows (its output is allocated uninitialised), so the target's
    features there are garbage, different between a graph's replay and an eager call: with those rows set to NaN, the
    drafts of every request and the output are what they are without."""
    runs = []
    for poison in (False, True):
        llm = make_llm(target_dir, heads[method], method, padded=True, **CHUNKED)
        runner = llm.engine.runner
        real_forward, real_propose = runner.target_forward, runner.propose
        drafts, poisoned = [], []

        def target_forward(x, max_query_len, all_rows=False, small_query_len=None, real_forward=real_forward,
                           poisoned=poisoned):
            logits, aux = real_forward(x, max_query_len, all_rows, small_query_len)
            real = int(x["query_start_loc"][-1])
            if poison and real < len(aux):
                aux[real:] = float("nan")
                poisoned.append(len(aux) - real)
            return logits, aux

        def propose(x, aux, num_rejected, next_tokens, max_query_len, small_query_len=None, num_drafts=None,
                    real_propose=real_propose, drafts=drafts):
            out = real_propose(x, aux, num_rejected, next_tokens, max_query_len, small_query_len, num_drafts)
            num_real = int((x["query_start_loc"][1:] > x["query_start_loc"][:-1]).sum())
            drafts.append(out[:num_real].tolist())
            return out

        runner.target_forward, runner.propose = target_forward, propose
        outs = llm.generate(PROMPTS, params(), use_tqdm=False)
        runs.append(([o.token_ids for o in outs], drafts, poisoned))
    (clean_out, clean_drafts, _), (out, poisoned_drafts, poisoned) = runs
    assert poisoned, "no padded step: nothing was checked"
    assert clean_drafts and all(not any(any(t < 0 for t in row) for row in d) for d in poisoned_drafts)
    assert poisoned_drafts == clean_drafts
    assert out == clean_out


def _caches(runner) -> list[torch.Tensor]:
    kv = list(runner.target_kv) + (list(runner.proposer.kv_caches) if runner.proposer is not None else [])
    return [t for pair in kv for t in pair]


class FakeSeq:
    def __init__(self, token_ids, num_computed, block_table, drafts=()):
        self.token_ids, self.num_computed_tokens, self.block_table = token_ids, num_computed, block_table
        self.draft_token_ids = list(drafts)

    @property
    def num_tokens(self):
        return len(self.token_ids)


def fake_runner(block_size=4, scratch=50, width=12):
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.scratch_block, runner.max_blocks_per_seq = block_size, scratch, width
    return runner


def test_pad_inputs_keeps_the_real_rows_and_pads_into_the_scratch_block():
    rng = random.Random(0)
    runner = fake_runner()
    tok = lambda n: [rng.randrange(1000) for _ in range(n)]  # noqa: E731
    seqs = [FakeSeq(tok(9), 8, [3, 7, 9], drafts=tok(3)),  # a decode verifying 3 drafts
            FakeSeq(tok(14), 5, [1, 2, 4, 5]),  # a prefill over 5 computed tokens (a later chunk)
            FakeSeq(tok(6), 0, [6, 8]),  # a new prompt, chunked to 4 tokens
            FakeSeq(tok(5), 4, [10, 11], drafts=tok(1))]  # a decode with fewer drafts than K
    drafts = [s.draft_token_ids for s in seqs]
    chunks = [4, 9, 4, 2]
    inp = runner.build_inputs(seqs, drafts, 3, chunks=chunks)
    n, t, b = len(inp.input_ids), 32, 8
    assert n == sum(chunks)
    pad = runner.pad_inputs(inp, t, b)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert np.array_equal(getattr(pad, name)[:n], getattr(inp, name)), name
        assert len(getattr(pad, name)) == t
    assert (pad.slot_mapping[n:] // runner.block_size == runner.scratch_block).all()
    assert (pad.positions[n:] < runner.block_size).all()
    assert np.array_equal(pad.query_start_loc, np.r_[inp.query_start_loc, [n] * (b - 4)])
    assert pad.query_start_loc.dtype == np.int32 and pad.max_query_len == t and pad.num_real == 4
    assert np.array_equal(pad.block_tables[:4], inp.block_tables)
    assert (pad.block_tables[4:] == runner.scratch_block).all()
    assert np.array_equal(pad.logit_rows[:4], inp.logit_rows) and (pad.logit_rows[4:] == n - 1).all()
    assert np.array_equal(pad.num_drafts, [3, 0, 0, 1, 0, 0, 0, 0])
    assert np.array_equal(pad.drafts[:4], inp.drafts) and not pad.drafts[4:].any()
    assert np.array_equal(pad.chunk_next[:4], inp.chunk_next) and (pad.chunk_next[4:] == -1).all()
    # The real requests' slots are their own blocks, never the scratch block.
    assert not (inp.slot_mapping // runner.block_size == runner.scratch_block).any()


def test_pad_inputs_of_an_exact_fit_adds_nothing_but_chunk_next():
    runner = fake_runner()
    seqs = [FakeSeq(list(range(16)), 0, [0, 1, 2, 3])]
    inp = runner.build_inputs(seqs, [[]], 0)
    pad = runner.pad_inputs(inp, 16, 1)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "logit_rows"):
        assert np.array_equal(getattr(pad, name), getattr(inp, name)), name
    assert np.array_equal(pad.chunk_next, [-1]) and pad.max_query_len == 16


def test_buckets():
    assert token_buckets(8) == [8]
    assert token_buckets(16) == [16]
    assert token_buckets(24) == [16, 24]
    assert token_buckets(512) == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert token_buckets(600) == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512, 600]
    assert token_buckets(4096)[-5:] == [1024, 1280, 1536, 1792, 2048]  # capped: larger steps run eagerly
    assert len(token_buckets(4096)) == 20
    # one bucket per doubling: the powers of two of the ladder before
    assert token_buckets(4096, 1) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(4096, 2)[3:9] == [128, 192, 256, 384, 512, 768]
    with pytest.raises(ValueError, match="power of two"):
        token_buckets(512, 3)
    # no bucket pads a step by more than a quarter once past the fine ladder's start
    ladder = token_buckets(2048)
    assert all(b / a <= 1.25 for a, b in zip(ladder, ladder[1:]) if a >= 128)
    assert request_buckets(1) == [1]
    assert request_buckets(3) == [1, 2, 3]
    assert request_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert request_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert request_buckets(256) == [1, 2, 4, 8, 16, 32, 64]  # capped: larger steps run eagerly


def test_key_for_edges_and_bounds(target_dir, monkeypatch):
    engine = make_llm(target_dir, None, None, padded=False, max_num_batched_tokens=100).engine
    graphs = engine.general_graphs(capture=False)
    assert graphs.token_buckets == [16, 32, 64, 100] and graphs.request_buckets == [1, 2, 4]
    assert graphs.key_for(1, 1, 0) == (16, 1, 0)
    assert graphs.key_for(16, 2, 0) == (16, 2, 0)
    assert graphs.key_for(17, 3, 0) == (32, 4, 0)
    assert graphs.key_for(100, 4, 0) == (100, 4, 0)
    assert graphs.key_for(101, 1, 0) is None  # more tokens than the largest bucket
    assert graphs.key_for(16, 5, 0) is None  # more requests than the largest bucket
    graphs.failed.add((32, 1, 0))  # a key whose capture failed runs eagerly from then on
    assert graphs.key_for(20, 1, 0) is None
    monkeypatch.setattr(cuda_graph, "MAX_GENERAL_KEYS", 2)
    graphs.captured |= {(16, 1, 0), (64, 2, 0)}
    assert graphs.key_for(10, 1, 0) == (16, 1, 0)  # captured keys still replay once the bound is reached
    assert graphs.key_for(10, 4, 0) is None  # a new key does not capture past the bound


def test_prefill_cuda_graphs_config_and_cli(target_dir):
    from peagle.cli import build_parser

    assert EngineConfig(model="m").prefill_cuda_graphs is True
    parse = build_parser().parse_args
    assert parse(["serve", "m"]).prefill_cuda_graphs is True
    assert parse(["serve", "m", "--prefill-cuda-graphs"]).prefill_cuda_graphs is True
    assert parse(["serve", "m", "--no-prefill-cuda-graphs"]).prefill_cuda_graphs is False
    llm = cpu_llm(target_dir, prefill_cuda_graphs=True)
    assert llm.engine.config.prefill_cuda_graphs and llm.engine.runner.general_graphs is None  # CUDA only
    # `peagle regenerate` takes the option too, and hands it to its engine.
    from peagle.training.regenerate import make_engine

    regen = ["regenerate", "--model", "m", "--prompts", "p", "--out", "o"]
    assert parse(regen).prefill_cuda_graphs is True
    assert parse([*regen, "--no-prefill-cuda-graphs"]).prefill_cuda_graphs is False
    engine = make_engine(target_dir, speculative_config=None, dtype="float32", device="cpu", max_model_len=96,
                         max_num_seqs=4, prefill_cuda_graphs=False)
    assert engine.config.prefill_cuda_graphs is False


def check_attention_at_the_bucket(num_splits):
    # A prefill over computed tokens, a verify and a decode (46 rows), then two empty padding requests and 18 rows
    # of no request: T = 64 at max_query_len 64, as a graph of that bucket calls the kernel.
    lens, real = [37, 8, 1, 0, 0], 46
    batch = make_attention_batch(1, lens, [50, 60, 20, 1, 1], num_kv_heads=2, group=3, head_dim=16,
                                 dtype=torch.float32, shuffle=False, tail=64 - real)
    attend = triton_kernels("paged_attention").paged_attention
    padded = attend(**{**batch, "max_query_len": 64}, num_splits=num_splits)
    unpadded = {**batch, "q": batch["q"][:real], "positions": batch["positions"][:real],
                "block_tables": batch["block_tables"][:3], "query_start_loc": batch["query_start_loc"][:4]}
    want = attend(**unpadded, num_splits=num_splits)
    torch.testing.assert_close(padded[:real], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[:real], kernels.paged_attention_ref(**unpadded), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_attention_kernel_serves_a_padded_bucket(interpreted, num_splits):
    interpreted(check_attention_at_the_bucket, num_splits)


def check_engine_padding_on_triton_kernels(model_dir):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40] * 20]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 4, 3)]
    spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3, "parallel_drafting": True}
    tokens = []
    os.environ[kernels.BACKEND_ENV] = "triton"
    try:
        for padded in (False, True):
            llm = LLM(model=model_dir, load_format="dummy", dtype="float32", device="cpu", max_model_len=128,
                      max_num_seqs=2, speculative_config=spec)
            sharpen_attention(llm.engine.target)
            if padded:
                llm.engine.runner.general_graphs = llm.engine.general_graphs(capture=False)
            tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    finally:
        del os.environ[kernels.BACKEND_ENV]
    assert tokens[0] == tokens[1]


def test_engine_padding_on_triton_kernels(interpreted, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    interpreted(check_engine_padding_on_triton_kernels, str(tmp_path))


def reference_general_inputs(runner, seqs, drafts, k, pad_to=None, chunks=None) -> dict:
    """General step inputs built request by request (the builder before it was vectorised): the specification."""
    bs = runner.block_size
    ids, pos, slots, lens = [], [], [], []
    tables = np.full((pad_to or len(seqs), runner.max_blocks_per_seq), runner.scratch_block, dtype=np.int32)
    chunk_next = None if chunks is None else np.full(len(tables), -1, dtype=np.int64)
    for b, (seq, d) in enumerate(zip(seqs, drafts)):
        nc = seq.num_computed_tokens
        feed = seq.token_ids[nc:] + d
        if chunks is not None and chunks[b] < len(feed):
            feed = feed[:chunks[b]]
            chunk_next[b] = seq.token_ids[nc + chunks[b]]
        p = np.arange(nc, nc + len(feed), dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        ids.append(np.asarray(feed, dtype=np.int64))
        pos.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        tables[b, :len(table)] = table
        lens.append(len(feed))
    num_drafts = [len(d) for d in drafts]
    drafts_arr = np.zeros((len(tables), k), dtype=np.int64)
    for b, d in enumerate(drafts):
        drafts_arr[b, :len(d)] = d
    for _ in range(len(tables) - len(seqs)):
        ids.append(np.zeros(k + 1, dtype=np.int64))
        pos.append(np.arange(k + 1, dtype=np.int64))
        slots.append(runner.scratch_block * bs + np.arange(k + 1, dtype=np.int64) % bs)
        lens.append(k + 1)
        num_drafts.append(k)
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    nd = np.asarray(num_drafts, dtype=np.int64)
    rows = np.minimum(qsl[1:, None] - (nd[:, None] + 1) + np.arange(k + 1)[None, :], qsl[1:, None] - 1)
    return {"input_ids": np.concatenate(ids), "positions": np.concatenate(pos), "slot_mapping": np.concatenate(slots),
            "query_start_loc": qsl, "block_tables": tables, "logit_rows": rows, "drafts": drafts_arr,
            "num_drafts": nd, "max_query_len": max(lens), "num_real": len(seqs), "chunk_next": chunk_next}


@pytest.mark.parametrize("seed", range(6))
def test_general_inputs_equal_the_request_by_request_build(seed):
    """Random mixes of new prompts, later chunks, recomputed sequences and decodes with 0..k drafts, with and
    without chunks and graph-bucket padding: the vectorised builder gives what the per-request build gives."""
    rng = random.Random(seed)
    runner = fake_runner(block_size=4, scratch=500, width=40)
    k = rng.choice([0, 1, 3, 7])
    seqs, next_block = [], 0
    for _ in range(rng.randrange(1, 12)):
        n = rng.randrange(1, 60)
        kind = rng.choice(["prompt", "later", "decode", "decode"])
        computed = {"prompt": 0, "later": rng.randrange(0, n), "decode": n - 1}[kind]
        blocks = -(-(n + 2 * k) // 4)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        d = [rng.randrange(1000) for _ in range(rng.randrange(0, k + 1))] if kind == "decode" else []
        seqs.append(FakeSeq([rng.randrange(1000) for _ in range(n)], computed, table, drafts=d))
    drafts = [s.draft_token_ids for s in seqs]
    k_step = max((len(d) for d in drafts), default=0)
    chunks = None
    if seed % 2:
        chunks = [max(1, rng.randrange(1, s.num_tokens - s.num_computed_tokens + 1)) if not s.draft_token_ids
                  else s.num_tokens - s.num_computed_tokens + len(s.draft_token_ids) for s in seqs]
    pad_to = len(seqs) + rng.choice([0, 0, 1, 3])
    got = runner._build_general_inputs(seqs, drafts, k_step, pad_to, chunks)
    want = reference_general_inputs(runner, seqs, drafts, k_step, pad_to, chunks)
    for name, value in want.items():
        mine = getattr(got, name)
        if isinstance(value, np.ndarray):
            assert mine.dtype == value.dtype and np.array_equal(mine, value), name
        else:
            assert mine == value, name
