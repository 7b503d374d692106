"""Greedy generation with vLLM, run by the interop check in vLLM's own virtual environment (no peagle import).

    python vllm_generate.py REQUEST.json RESULT.json

REQUEST: {"target": DIR, "prompts": [[token ids], ...], "max_tokens": N, "speculative_config": {...} | null}.
RESULT: {"outputs": [[token ids], ...], "spec_decode": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
"num_accepted_tokens_per_pos"} (vLLM's vllm:spec_decode_* counters; zeros without speculation), "vllm": version}.
"""

import json
import sys

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(llm) -> dict:
    metrics = {m.name: m for m in llm.get_metrics()}
    out = {name: int(getattr(metrics.get(f"vllm:spec_decode_{name}"), "value", 0)) for name in COUNTERS}
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    out["num_accepted_tokens_per_pos"] = list(per_pos.values) if per_pos is not None else []
    return out


def main(request_file: str, result_file: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    request = json.loads(open(request_file).read())
    # The CPU build sizes its KV cache from this fraction of the machine's memory; eager mode starts in about 40 s
    # instead of about 160 s with compilation; the "uni" executor (with VLLM_ENABLE_V1_MULTIPROCESSING=0 from the
    # caller) keeps engine and worker in this process, which saves two interpreter starts per engine.
    llm = LLM(model=request["target"], dtype="float32", max_model_len=request.get("max_model_len", 512),
              max_num_seqs=len(request["prompts"]), gpu_memory_utilization=0.3, enforce_eager=True, seed=0,
              speculative_config=request["speculative_config"], disable_log_stats=False, distributed_executor_backend="uni")
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "spec_decode": spec_decode_counters(llm),
              "vllm": vllm.__version__}
    with open(result_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM may spawn its engine process, which re-imports this file
    main(*sys.argv[1:3])
