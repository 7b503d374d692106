"""A mixture-of-experts target (a tiny Qwen3-MoE): vLLM's CPU build and peagle agree on its greedy output, and serve
a P-EAGLE head that peagle trained against it with unchanged output and the same drafts accepted."""

from __future__ import annotations

import json

import pytest

import interop_fixtures as fixtures
from conftest import (COMMON_TRAIN_ARGS, MAX_TOKENS, SPECULATIVE_CONFIGS, TRAIN_ARGS, peagle_cli, run_interop)


@pytest.fixture(scope="module")
def moe(interop_python, workdir):
    """The target, and its P-EAGLE head trained on answers it wrote (`peagle regenerate` + `peagle train`)."""
    root = workdir / "moe"
    fixtures.write_moe_target(root / "target")
    fixtures.write_prompts(root / "train_prompts.jsonl", fixtures.prompts(fixtures.TRAIN_MODULES, 48, seed=0))
    peagle_cli("regenerate.log", "regenerate", "--model", "target", "--prompts", "train_prompts.jsonl", "--out", "data",
               "--max-tokens", "48", "--batch-size", "48", "--dtype", "float32", "--device", "cpu",
               "--max-model-len", "512", cwd=root)
    peagle_cli("train.log", "train", "--target", "target", "--data", "data", "--method", "peagle", "--out", "run",
               *TRAIN_ARGS["peagle"], *COMMON_TRAIN_ARGS, cwd=root)
    return root


def vllm(interop_python, root, eval_prompts, name, spec):
    request, result = root / f"vllm-request-{name}.json", root / f"vllm-result-{name}.json"
    request.write_text(json.dumps({"target": str(root / "target"), "prompts": eval_prompts, "max_tokens": MAX_TOKENS,
                                   "speculative_config": spec}))
    run_interop(interop_python, root, f"vllm-{name}.log", "vllm_generate.py", str(request), str(result))
    return json.loads(result.read_text())


def peagle(root, eval_prompts, spec):
    from peagle import LLM, SamplingParams

    llm = LLM(model=str(root / "target"), speculative_config=spec, dtype="float32", device="cpu", max_model_len=512,
              max_num_seqs=len(eval_prompts))
    outs = llm.generate(eval_prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    metrics = [o.metrics for o in outs]
    counters = {"num_drafts": sum(m.num_drafting_rounds for m in metrics),
                "num_draft_tokens": sum(m.num_draft_tokens for m in metrics),
                "num_accepted_tokens": sum(m.num_accepted_tokens for m in metrics),
                "num_accepted_tokens_per_pos": ([sum(c) for c in zip(*(m.accepted_per_position for m in metrics))]
                                                if spec else [])}
    return {"outputs": [list(o.token_ids) for o in outs], "spec_decode": counters}


def test_vllm_serves_a_moe_target_and_its_peagle_head_as_peagle_does(moe, interop_python, eval_prompts):
    spec = {**SPECULATIVE_CONFIGS["peagle"], "model": str(moe / "run" / "final")}
    plain_vllm, plain_peagle = vllm(interop_python, moe, eval_prompts, "plain", None), peagle(moe, eval_prompts, None)
    assert plain_vllm["outputs"] == plain_peagle["outputs"], "the two engines disagree on the MoE target"
    spec_vllm, spec_peagle = vllm(interop_python, moe, eval_prompts, "peagle", spec), peagle(moe, eval_prompts, spec)
    assert spec_vllm["outputs"] == plain_vllm["outputs"], "vLLM's output changes with the head"
    assert spec_peagle["outputs"] == plain_peagle["outputs"], "peagle's output changes with the head"
    assert spec_vllm["spec_decode"] == spec_peagle["spec_decode"]
    assert spec_peagle["spec_decode"]["num_accepted_tokens"] > 0, spec_peagle["spec_decode"]
