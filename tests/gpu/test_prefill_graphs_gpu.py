"""General-step CUDA graphs (prefill_cuda_graphs) on the GPU: greedy output with them equals the output of eager
general steps, token for token in fp32, without speculation and with EAGLE-3 and P-EAGLE drafting, with chunked
prefill and async scheduling; and a captured graph's replay equals an eager call of its function on the same static
buffers. Timing: scripts/device/engine_timing.py --variants sync,prefill-graphs. The mixed steps' attention in two
launches (mixed_tiles), the KV splits merged inside the attention kernel (fused_merge) and programmatic dependent
launch (peagle.kernels.pdl) keep the same output."""

from __future__ import annotations

import importlib

import pytest
import torch

from peagle import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Prompt lengths across token buckets, more prompts than max_num_seqs: new prompts prefill beside running decodes.
PROMPTS = [[5 + i % 50 for i in range(n)] for n in (3, 17, 40, 9, 130, 300, 1, 64)]
SPECS = {"none": None,
         "eagle3": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3},
         "peagle": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 5, "parallel_drafting": True}}
VARIANTS = {"plain": {}, "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64},
            "async": {"async_scheduling": True}}



def make_llm(model_dir, method, graphs, **kw):
    return LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=4,
               speculative_config=SPECS[method], prefill_cuda_graphs=graphs, **kw)


def params():
    return [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]


_REFERENCE: dict[tuple, list[list[int]]] = {}


def reference(model_dir, method, **kw):
    """The greedy tokens of eager general steps with `kw`'s options, built once per method and options: a variant
    with or without graphs for general steps gives exactly these in fp32 (the graphs' own test holds graphed and
    eager steps equal), so a test builds one engine fewer."""
    key = (model_dir, method, tuple(sorted(kw.items())))
    if key not in _REFERENCE:
        llm = make_llm(model_dir, method, False, **kw)
        _REFERENCE[key] = [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    return _REFERENCE[key]


def sampled():
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("method", sorted(SPECS))
def test_graphed_general_steps_keep_greedy_output(model_dir, method, variant):
    outs = {}
    for graphs in (False, True):
        llm = make_llm(model_dir, method, graphs, **VARIANTS[variant])
        outs[graphs] = [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)]
        general = llm.engine.runner.general_graphs
        if graphs:
            assert general.captured and not general.failed, (general.captured, general.failed)
            # greedy steps replay one graph per key: target, verification and (with a drafter) drafting
            kind = "greedy" if method != "none" else "greedy_plain"
            assert all((kind, *key) in general.graphs for key in general.captured)
            assert not any(("target", *key) in general.graphs for key in general.captured)
        else:
            assert general is None
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_admit_ahead_keeps_greedy_output(model_dir, method, graphs):
    """Prompts admitted in a step launched before the answer in flight (admit_ahead: staged pinned inputs, the
    decodes' rows written by the Triton kernel into the general graph's buffers) give the output of the engine
    without async scheduling, and the path did run."""
    ref = reference(model_dir, method)
    llm = make_llm(model_dir, method, graphs, async_scheduling=True, admit_ahead=True)
    calls, real = [], llm.engine.runner.launch_admit_next
    llm.engine.runner.launch_admit_next = lambda *a: calls.append(len(a[3])) or real(*a)
    assert [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)] == ref
    assert calls


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_mixed_tiles_keep_greedy_output(model_dir, method, graphs, monkeypatch):
    """Mixed steps' attention in two launches (mixed_tiles: short requests in small tiles, long ones by a tile map
    made on the device inside the graph) gives the output of one launch, token for token in fp32, and it ran."""
    module = importlib.import_module("peagle.kernels.paged_attention")  # the package exports a function of that name
    ref = reference(model_dir, method, mixed_tiles=False)  # one launch
    maps, real = [], module._launch
    monkeypatch.setattr(module, "_launch", lambda *a, **kw: maps.append(kw.get("map_mode", 0)) or real(*a, **kw))
    llm = make_llm(model_dir, method, graphs, mixed_tiles=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)] == ref
    assert 2 in maps


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_fused_merge_keeps_greedy_output(model_dir, method, graphs, monkeypatch):
    """The KV splits merged by their last arrival inside the attention kernel (fused_merge, on by default since run
    17) give the output of the separate merge kernel, token for token in fp32, with async scheduling (the engine's
    default) and with or without graphs for general steps; fused split calls did run, and every arrival counter is
    back at zero afterwards (a counter left behind would merge a later call's splits early)."""
    module = importlib.import_module("peagle.kernels.paged_attention")
    ref = reference(model_dir, method, async_scheduling=True, fused_merge=False)
    fused, real = [], module._arrivals  # called by split calls that merge inside the kernel only
    monkeypatch.setattr(module, "_arrivals", lambda *a: fused.append(real(*a)) or fused[-1])
    llm = make_llm(model_dir, method, graphs, async_scheduling=True, fused_merge=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)] == ref
    assert any(b is not None for b in fused)
    torch.cuda.synchronize()
    assert all(int(b.abs().sum()) == 0 for bufs in module._arrivals_buffers.values() for b in bufs)


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_pdl_keeps_greedy_output(model_dir, method, graphs, gemv, monkeypatch):
    """The Triton kernels launched with programmatic dependent launch (peagle.kernels.pdl.ENABLED: each waits for the
    kernel before, then lets the next one start) give the output of ordinary launches, token for token in fp32, with
    and without CUDA graphs for general steps and with the GEMV path (decode_gemv: every linear a Triton kernel, so
    whole layers chain by PDL), and PDL launches did happen."""
    from peagle.kernels import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or newer")
    ref = reference(model_dir, method) if not gemv else [o.token_ids for o in make_llm(
        model_dir, method, graphs, decode_gemv=gemv).generate(PROMPTS, params(), use_tqdm=False)]
    monkeypatch.setattr(pdl, "ENABLED", True)
    launched, real = [], pdl.options
    monkeypatch.setattr(pdl, "options", lambda device: launched.append(real(device)) or launched[-1])
    llm = make_llm(model_dir, method, graphs, decode_gemv=gemv)
    assert [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)] == ref
    assert {"USE_PDL": True, "launch_pdl": True} in launched


@pytest.mark.parametrize("method", ["none", "peagle"])
def test_replay_equals_an_eager_call_on_the_static_buffers(model_dir, method):
    llm = make_llm(model_dir, method, True)
    # seeded sampling: its steps replay the target graph (greedy steps replay one fused graph instead)
    llm.generate(PROMPTS, sampled(), use_tqdm=False)
    general = llm.engine.runner.general_graphs
    key = general.current  # the static buffers still hold this key's last inputs
    graph, (logits, aux) = general.graphs[("target", *key)]
    graph.replay()
    torch.cuda.synchronize()
    replayed = (logits.clone(), None if aux is None else aux.clone())
    with torch.inference_mode():
        eager_logits, eager_aux = general._target_fn(*key)()
    torch.testing.assert_close(replayed[0], eager_logits, atol=1e-5, rtol=1e-5)
    if aux is not None:
        # The real tokens' rows: padding tokens belong to no request, so attention never writes their rows (its
        # output is allocated uninitialised, in the graph's pool on replay and the allocator's eagerly) and nothing
        # reads them (`ModelRunner.pad_inputs`).
        real = int(general._views(key)["query_start_loc"][-1])
        assert 0 < real <= key[0], (real, key)
        torch.testing.assert_close(replayed[1][:real], eager_aux[:real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["none", "peagle"])
def test_greedy_replay_equals_an_eager_call_on_the_static_buffers(model_dir, method):
    """The fused greedy graph of general steps (target, verification, drafting in one replay) answers as
    `ModelRunner.general_greedy_step` does eagerly on the same static buffers."""
    llm = make_llm(model_dir, method, True)
    llm.generate(PROMPTS, params(), use_tqdm=False)
    general = llm.engine.runner.general_graphs
    key = general.current  # the static buffers still hold this key's last inputs
    draft = method != "none"
    graph, packed = general.graphs[("greedy" if draft else "greedy_plain", *key)]
    graph.replay()  # rewrites the KV it wrote, with the same values
    torch.cuda.synchronize()
    replayed = packed.clone()
    with torch.inference_mode():
        eager = llm.engine.runner.general_greedy_step(general._views(key), key[0], key[2], draft)
    real = int((general._views(key).query_start_loc.diff() > 0).sum())  # padding requests are empty
    assert real > 0 and torch.equal(replayed[:real], eager[:real])


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_adaptive_policy_drafts_what_it_verifies_under_graphs(model_dir, method, async_scheduling):
    """With an adaptive policy whose K falls with the load (1 draft above 2 running requests, 2 up to 2, the
    engine's K for one), CUDA-graphed steps propose only the drafts their K verifies and a rise in K proposes the
    new count, laid out as that count's step with the missing drafts padded (graphed as it is): greedy output
    equals plain greedy output, token for token in fp32, and each count was proposed
    (propose_verified_only, on by default)."""
    ref = [o.token_ids for o in make_llm(model_dir, "none", True).generate(PROMPTS, params(), use_tqdm=False)]
    k = SPECS[method]["num_speculative_tokens"]
    spec = {**SPECS[method], "adaptive": {"thresholds": [[1, k], [2, 2]], "above": 1}}
    llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=4,
              speculative_config=spec, async_scheduling=async_scheduling, propose_verified_only=True)
    steps, real = [], llm.engine.runner._run  # (drafts verified, drafts proposed) per step

    def run(x, st, verified, *a, **kw):
        handle = real(x, st, verified, *a, **kw)
        steps.append((verified, handle.num_drafts))
        return handle

    llm.engine.runner._run = run
    assert [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)] == ref
    assert any(v == 1 and d == 1 for v, d in steps)  # under load: one draft verified, one proposed
    assert {1, 2, k} <= {d for _, d in steps}
    assert all(d >= v for v, d in steps if d)  # never fewer proposed than verified (K only falls by the load)
    # a rise in K is laid out as the new K's step (the missing drafts padded), so it proposes what it verifies
    assert all(d == v for v, d in steps if d and v), steps
    assert sorted({key[2] for key in llm.engine.runner.graphs.graphs if key[0] == "draft"}) == [1, 2, k]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_adaptive_rise_beside_an_admitted_prompt_replays_graphs(model_dir, method, async_scheduling):
    """Two requests at a time and the engine's K for one, 2 for two (the calibrated policy's shape at concurrency 2,
    BENCHMARKS.md run 23): when a request finishes, the survivor's K rises in the step that admits the next prompt.
    That step proposes what its K's graphs propose (it ran eagerly before), and greedy output equals plain greedy."""
    ref = [o.token_ids for o in make_llm(model_dir, "none", True).generate(PROMPTS, params(), use_tqdm=False)]
    k = SPECS[method]["num_speculative_tokens"]
    spec = {**SPECS[method], "adaptive": {"thresholds": [[1, k]], "above": 2}}
    llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=2,
              speculative_config=spec, async_scheduling=async_scheduling)
    runner = llm.engine.runner
    steps, real = [], runner._run  # (drafts verified, drafts proposed, replayed a graph) per step that drafts

    def run(x, st, verified, num_real, max_query_len, graphs, draft, *a, **kw):
        handle = real(x, st, verified, num_real, max_query_len, graphs, draft, *a, **kw)
        if handle.num_drafts:
            steps.append((verified, handle.num_drafts, graphs is not None))
        return handle

    runner._run = run
    assert [o.token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)] == ref
    assert all(d == runner.draft_count(v) for v, d, _ in steps), steps  # what a graph of its K proposes
    assert {2, k} <= {v for v, _, _ in steps}
    assert any(g for v, _, g in steps if v)  # graphs ran the decodes (a general step may run eagerly at its cap)


@pytest.mark.parametrize("method", ["none", "peagle"])
def test_target_graphs_write_one_shared_output(model_dir, method):
    """Every decode and general target graph copies its logits (and aux) into the runner's one pair of buffers
    (outputs kept per graph would hold GiBs over a large vocabulary's buckets), and seeded sampling, whose steps
    replay those graphs, samples what eager steps sample."""
    llm = make_llm(model_dir, method, True)
    out = [o.token_ids for o in llm.generate(PROMPTS, sampled(), use_tqdm=False)]
    runner = llm.engine.runner
    logits0, aux0 = runner.graph_outputs(0, 0)
    targets = [o for (kind, *_), (_, o) in [*runner.graphs.graphs.items(), *runner.general_graphs.graphs.items()]
               if kind == "target"]
    assert len(targets) > len(runner.graphs.buckets)
    for logits, aux in targets:
        assert logits.untyped_storage().data_ptr() == logits0.untyped_storage().data_ptr()
        assert (aux is None) == (aux0 is None) == (method == "none")
        assert aux is None or aux.untyped_storage().data_ptr() == aux0.untyped_storage().data_ptr()
    del llm
    eager = make_llm(model_dir, method, False, enforce_eager=True)
    assert [o.token_ids for o in eager.generate(PROMPTS, sampled(), use_tqdm=False)] == out
