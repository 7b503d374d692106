"""vLLM's CPU build serves peagle's trained EAGLE-3 and P-EAGLE heads as peagle exports them, and agrees with peagle:
the same greedy tokens with and without speculation, and the same drafts accepted (vLLM's vllm:spec_decode_*
counters equal peagle's per-request metrics summed over the prompts)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from conftest import SPECULATIVE_CONFIGS

# Acceptance length the briefly trained heads must reach, so that equal counters compare accepted drafts and not
# merely rejected ones (measured: about 1.8 for both heads).
MIN_ACCEPTANCE_LENGTH = 1.3


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_the_exported_head_is_what_vllm_loads(method, trained_heads, target):
    head = trained_heads[method]
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())  # a full draft vocabulary: vLLM refuses the maps
    config = json.loads((head / "config.json").read_text())
    # Trained with --target given relative to the working directory; the head names it absolutely.
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target.resolve())


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_vllm_output_and_acceptance_equal_peagles(method, trained_heads, plain, vllm_generate, peagle_generate):
    spec = {**SPECULATIVE_CONFIGS[method], "model": str(trained_heads[method])}
    vllm, peagle = vllm_generate(method, spec), peagle_generate(spec)
    assert plain["vllm"]["outputs"] == plain["peagle"]["outputs"], "the two engines disagree without speculation"
    assert vllm["outputs"] == plain["vllm"]["outputs"], "vLLM's output changes with the head"
    assert peagle["outputs"] == plain["peagle"]["outputs"], "peagle's output changes with the head"
    counters = peagle["spec_decode"]
    assert vllm["spec_decode"] == counters
    assert 1 + counters["num_accepted_tokens"] / counters["num_drafts"] >= MIN_ACCEPTANCE_LENGTH, counters
