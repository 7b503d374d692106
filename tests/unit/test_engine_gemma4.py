"""The engine serves Gemma 4 as released: global layers with heads of another width and KV-head count, keys as
values, and layers that attend with an earlier layer's keys and values (KV sharing), losslessly with both drafters."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, make_llm, recompute_greedy
from test_models_gemma import GEMMA4_VARIANTS, _gemma4_checkpoint

from peagle.drafters import Drafter, save_drafter
from peagle.engine.attention import kv_bytes_per_block
from peagle.models.loader import load_model

# Past the 6-token window; token ids only (the tiny checkpoint has no tokenizer).
PROMPTS = [[7, 20, 31, 40, 41, 42, 43, 44, 45, 46], [9, 15], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
SERVED = ["per_layer_inputs_kv_sharing", "global_heads_keys_as_values"]


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    target = tmp_path_factory.mktemp(request.param)
    _gemma4_checkpoint(target, **GEMMA4_VARIANTS[request.param])
    outs = make_llm(target).generate(PROMPTS, greedy(24), use_tqdm=False)
    return target, [o.token_ids for o in outs]


def test_plain_engine_equals_full_recompute(served):
    target, plain = served
    model = load_model(target, dtype="float32")
    for prompt, out in zip(PROMPTS, plain):
        assert recompute_greedy(model, prompt, 24)[len(prompt):] == out


@pytest.mark.parametrize("method,k", [("eagle3", 3), ("peagle", 5)])
def test_speculative_greedy_equals_plain_greedy(served, tmp_path, method, k):
    target, plain = served
    head = tmp_path / "head"
    save_drafter(Drafter.for_target(target, method, 2 if method == "peagle" else 1, seed=5, mask_token_id=299), head)
    outs = make_llm(target, head, k=k, parallel=method == "peagle").generate(PROMPTS, greedy(24), use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    assert all(o.metrics.num_drafting_rounds > 0 for o in outs)


def test_kv_cache_per_layer_shapes_and_shared_layers(tmp_path):
    _gemma4_checkpoint(tmp_path, **GEMMA4_VARIANTS["per_layer_inputs_kv_sharing"])
    llm = make_llm(tmp_path)
    caches = llm.engine.runner.target_kv
    widths = [k.shape[-1] for k, _ in caches]
    assert widths == [16, 16, 32, 16, 16, 32, 16, 32]
    assert caches[6][0] is caches[4][0] and caches[7][1] is caches[5][1]  # layers 6 and 7 read 4's and 5's
    layers = llm.engine.target.kv_layers()
    owners = {id(k) for k, _ in caches}
    assert len(owners) == 6
    # a block holds 2 (k, v) x 16 tokens x (4 sliding layers x 2 heads x 16 + 2 global x 2 heads x 32) fp32 values
    assert kv_bytes_per_block(layers, 16, torch.float32) == 2 * 16 * (4 * 2 * 16 + 2 * 2 * 32) * 4
