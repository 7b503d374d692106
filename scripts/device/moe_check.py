"""Device check of the mixture-of-experts targets at their real shapes (random weights, synthetic acceptance).

Usage: python scripts/device/moe_check.py SHAPE OUT.json --tokenizer DIR [--batches 1,64] [--runs none,peagle-k7,...]
SHAPE is qwen3-30b-a3b or gpt-oss-20b (config.json values of the released checkpoints; experts in bf16). DIR holds any
tokenizer (its ids only need to fit the vocabulary): the prompts are MT-Bench first turns.

Per shape it reports
- the batch-1 decode step (136 - 8 tokens over 128) against the active-weight bandwidth floor: every weight a token
  reads (attention, norms, router, its top-k experts, the output head) over the measured copy bandwidth;
- per run and batch, the steady-state round (scripts/device/engine_timing.py's `measure`): the target pass alone
  (its CUDA graph replayed) - for a speculative run the verify of K + 1 tokens a request, so verify / decode is
  target_ms over the plain run's - and the output tokens/s with the synthetic acceptance below;
- experts touched per layer by 1, 8, 64 and 512 tokens (mean over MoE layers, one eager forward of random tokens:
  random routers spread tokens about evenly, trained ones cluster, so this is an upper bound).
peagle-adaptive verifies K by load (7 up to 8 running requests, 5 up to 32, 3 beyond; `ADAPTIVE`).
Synthetic acceptance (accepted at position i / rounds) is each method's measured on MT-Bench with the testbed heads
(run 30, K=7, greedy): P-EAGLE 0.60, 0.33, 0.22, 0.16, 0.11, 0.09, 0.07; EAGLE-3 0.60, 0.37, 0.27, 0.20, 0.15, 0.10,
0.07. The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_timing import measure  # noqa: E402
from scale_check import copy_bandwidth, decode_ms  # noqa: E402

from peagle import LLM, SamplingParams  # noqa: E402
from peagle.bench.sweep import free_accelerator_memory  # noqa: E402
from peagle.datasets import load_prompts  # noqa: E402
from peagle.models.attention import DenseAttention  # noqa: E402
from peagle.models.loader import load_tokenizer  # noqa: E402
from peagle.models.moe import MoE  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "eos_token_id": 151645},
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
        "max_position_embeddings": 131072, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "eos_token_id": 200002},
}
PEAGLE_RATES = (0.60, 0.33, 0.22, 0.16, 0.11, 0.09, 0.07)
EAGLE3_RATES = (0.60, 0.37, 0.27, 0.20, 0.15, 0.10, 0.07)
# label -> (K, parallel drafting, rates, adaptive policy or None)
ADAPTIVE = {"thresholds": [[8, 7], [32, 5]], "above": 3}  # K 7 up to 8 running requests, 5 up to 32, 3 beyond
RUNS = {"none": (0, False, None, None), "eagle3-k3": (3, False, EAGLE3_RATES, None),
        "eagle3-k5": (5, False, EAGLE3_RATES, None), "peagle-k5": (5, True, PEAGLE_RATES, None),
        "peagle-k7": (7, True, PEAGLE_RATES, None), "peagle-adaptive": (7, True, PEAGLE_RATES, ADAPTIVE)}


def active_bytes(model) -> int:
    """The weights one token reads at batch 1: everything but the embedding table and the unrouted experts."""
    total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.startswith("embed_tokens"):
            size = p.shape[1] * p.element_size()  # one row
            if model.lm_head is None:
                size += p.numel() * p.element_size()  # tied: the output head reads it all
        elif name.rsplit(".", 1)[-1] in ("w13", "w2", "b13", "b2"):
            size = size * model.config.num_experts_per_tok // model.config.num_experts
        total += size
    return total


def experts_touched(model, vocab: int) -> dict[int, float]:
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    seen: list[int] = []

    def counting(route):
        def wrapped(x):
            weights, ids = route(x)
            seen.append(int(ids.unique().numel()))
            return weights, ids
        return wrapped

    for m in layers:
        m.route = counting(m.route)
    counts = {}
    try:
        for n in (1, 8, 64, 512):
            seen.clear()
            ids = torch.randint(0, vocab, (n,), device="cuda")
            with torch.inference_mode():
                model(ids, torch.arange(n, device="cuda"), DenseAttention([n]))
            counts[n] = sum(seen) / len(seen)
    finally:
        for m in layers:
            del m.route  # the class's method again
    return counts


def profile_decode(llm, prompt: list[int], path: str, steps: int = 16) -> dict:
    """Where a batch-1 decode step's GPU time goes: the kernels of STEPS steps (after the prefill), as a table."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    total_us = sum(e.device_time_total for e in kernels)
    lines = [f"{steps} decode steps and one prefill, batch 1: {sum(e.count for e in kernels)} kernel launches, "
             f"{total_us / 1e3:.2f} ms of kernel time", f"{'us total':>10}{'calls':>7}{'us each':>9}  kernel"]
    lines += [f"{e.device_time_total:>10.0f}{e.count:>7}{e.device_time_total / e.count:>9.1f}  {e.key[:110]}"
              for e in kernels[:40]]
    Path(path).write_text("\n".join(lines) + "\n")
    return {"steps": steps, "kernel_launches": sum(e.count for e in kernels), "kernel_ms": total_us / 1e3,
            "top": [{"kernel": e.key[:200], "us": e.device_time_total, "calls": e.count} for e in kernels[:15]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (and tokenizer_config.json)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--decode-gemv", action="store_true",
                    help="the engine's decode_gemv option: the target's linear layers (attention projections, "
                         "routers) called with at most 8 rows go through the Triton GEMV kernel, not cuBLAS")
    ap.add_argument("--profile", metavar="FILE", help="with the none run: the GPU kernels of 16 batch-1 decode steps "
                    "(CUDA graphs replayed), by total time, written to FILE")
    args = ap.parse_args()
    unknown = [r for r in args.runs.split(",") if r not in RUNS]
    if unknown:
        ap.error(f"unknown run(s) {unknown}; choose from {sorted(RUNS)}")
    if args.profile and "none" not in args.runs.split(","):
        ap.error("--profile profiles the none run's decode steps: add none to --runs")
    batches = [int(b) for b in args.batches.split(",")]
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(SHAPES[args.shape]))
    for f in Path(args.tokenizer).glob("tokenizer*"):
        shutil.copy(f, d)
    tok = load_tokenizer(d)
    prompts = [tok.encode_chat(p.messages) for p in load_prompts("mtbench")]
    result = {"shape": args.shape, "decode_gemv": args.decode_gemv, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__,
              "copy_bandwidth_Bps": copy_bandwidth(), "rows": []}

    def save():
        Path(args.out).write_text(json.dumps(result, indent=1))

    for label in args.runs.split(","):
        k, parallel, rates, adaptive = RUNS[label]
        spec = None if not k else {"method": "eagle3", "model": "dummy", "num_speculative_tokens": k,
                                   "parallel_drafting": parallel, **({"adaptive": adaptive} if adaptive else {})}
        start = time.perf_counter()
        llm = LLM(model=str(d), load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
                  max_num_seqs=max(batches), speculative_config=spec,
                  synthetic_acceptance=rates[:k] if rates else None, decode_gemv=args.decode_gemv)
        built_s = time.perf_counter() - start
        model = llm.engine.target
        if label == "none":
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            active = active_bytes(model)
            step = decode_ms(lambda n: llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=n,
                                                                                 ignore_eos=True), use_tqdm=False))
            result.update(weight_bytes=weights, active_bytes=active,
                          floor_ms=1e3 * active / result["copy_bandwidth_Bps"], decode_ms_batch1=step,
                          experts_touched=experts_touched(model, SHAPES[args.shape]["vocab_size"]))
            result["decode_vs_floor"] = step / result["floor_ms"]
            if args.profile:
                result["profile"] = profile_decode(llm, prompts[0], args.profile)
            print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
        for b in batches:
            k_here = llm.engine.config.speculative.adaptive.k_for(b, k) if adaptive else k  # the load's K
            row = {"run": label, "build_s": built_s, **measure(llm, prompts, b, k_here, rounds=30)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
        del llm, model
        free_accelerator_memory()
    plain = {r["batch"]: r for r in result["rows"] if r["run"] == "none"}
    for r in result["rows"]:
        if r["batch"] in plain:
            r["target_vs_decode"] = r["target_ms"] / plain[r["batch"]]["target_ms"]
            r["speedup_vs_none"] = r["output_tokens_per_s"] / plain[r["batch"]]["output_tokens_per_s"]
    save()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
