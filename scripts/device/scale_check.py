"""Device check at real size: Llama-3.1-8B-shaped random weights (no checkpoint), decode speed vs the bandwidth floor.

Usage: python scripts/device/scale_check.py OUT.json [--hf] [--concurrency 1,2,4,8,16,32,64]
Each concurrency is warmed (its shapes compiled and captured) before it is timed. The batch-1 decode step time is
(time for 136 tokens - time for 8 tokens) / 128, so the prompt's prefill is not in it. With --hf, transformers
(static cache, torch.compile) runs the same shape at batch 1 last, timed the same way. The JSON is rewritten after
every run, so a run cut short keeps what it measured.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from peagle import LLM, SamplingParams
from peagle.bench.sweep import free_accelerator_memory

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "eos_token_id": 128009}
CONCURRENCY = [1, 2, 4, 8, 16, 32, 64]
# The adaptive run: K=7 while at most 8 requests run, 5 up to 16, 3 beyond (deep speculation where the target pass is
# bandwidth-bound, shallower where verifying 8 tokens per request makes it compute-bound).
ADAPTIVE = {"thresholds": [[8, 7], [16, 5]], "above": 3}
RATES = [0.75, 0.55, 0.42, 0.33, 0.26, 0.2, 0.15]  # per-position acceptance used for the synthetic runs


def copy_bandwidth() -> float:
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def decode_ms(generate) -> float:
    """Per-token decode time at batch 1: generate(n) runs one request for n tokens; prefill cancels out."""
    generate(8)
    times = {}
    for n in (8, 136):
        start = time.perf_counter()
        generate(n)
        times[n] = time.perf_counter() - start
    return 1e3 * (times[136] - times[8]) / 128


def run(d, spec, rates, conc, repeat=1, **engine):
    llm = LLM(model=d, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=max(conc),
              speculative_config=spec, synthetic_acceptance=rates, **engine)
    runner, eager = llm.engine.runner, []
    real_run = runner._run
    runner._run = lambda *a, **kw: eager.append(a[5] is None) or real_run(*a, **kw)  # a[5]: graphs (None: eager)
    rows = []
    for c in conc:
        prompts = [[1000 + i, 2000, 3000 + i] for i in range(c)]
        p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        # Warm this concurrency's shapes (Triton variants compile on first use), then time.
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        for _ in range(repeat):  # --repeat: the same wave again (first-use costs show as a slower first wave)
            eager.clear()
            t = time.perf_counter()
            outs = llm.generate(prompts, p, use_tqdm=False)
            wall = time.perf_counter() - t
            rows.append({"concurrency": c, "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
                         "steps": len(eager), "eager_steps": sum(eager)})
    weights = sum(p.numel() * p.element_size() for p in llm.engine.target.parameters())
    step_ms = decode_ms(lambda n: llm.generate([[1000, 2000, 3000]], SamplingParams(temperature=0, max_tokens=n,
                                                                                   ignore_eos=True), use_tqdm=False))
    del llm
    free_accelerator_memory()  # a speculative engine holds reference cycles: collect them before the next one
    return rows, weights, step_ms


def hf_static_compile(d) -> dict:
    """transformers on the same random-weight shape: static cache, its own torch.compile of the forward, batch 1."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(d)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[1000, 2000, 3000]], device="cuda")

    def generate(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                           max_cache_len=256, pad_token_id=0)
        torch.cuda.synchronize()

    start = time.perf_counter()
    generate(8)  # compiles
    compile_s = time.perf_counter() - start
    step_ms = decode_ms(generate)
    del model
    free_accelerator_memory()
    return {"transformers": transformers.__version__, "compile_s": compile_s, "decode_ms_batch1": step_ms}


# The speculative runs timed after plain decoding: label -> (K, parallel drafting, adaptive policy or None).
SPECULATIVE_RUNS = {"eagle3-k3": (3, False, None), "peagle-k7": (7, True, None),
                    "peagle-k7-adaptive": (7, True, ADAPTIVE)}


def main(out: str, hf: bool, concurrency: list[int], gemv: bool = False, repeat: int = 1,
         only: str | None = None, propose_verified_only: bool = False) -> int:
    d = tempfile.mkdtemp()
    (Path(d) / "config.json").write_text(json.dumps(LLAMA_8B))
    bw = copy_bandwidth()
    result = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "synthetic_rates": RATES,
              "concurrency": concurrency, "adaptive": ADAPTIVE, "runs": {}}

    def save():
        Path(out).write_text(json.dumps(result, indent=1))

    none, weights, step_ms = run(d, None, None, concurrency if only is None else [1])
    result.update(weight_bytes=weights, floor_ms=1e3 * weights / bw, decode_ms_batch1=step_ms)
    result["decode_vs_floor"] = step_ms / result["floor_ms"]
    result["runs"]["none"] = none
    save()
    if gemv:  # the same engine with decode_gemv (the GEMV, the norms and the activation inside it)
        rows, _, ms = run(d, None, None, concurrency, decode_gemv=True)
        result["runs"]["none-gemv"] = rows
        result.update(decode_ms_batch1_gemv=ms, decode_vs_floor_gemv=ms / result["floor_ms"])
        save()
    for label, (k, par, adaptive) in SPECULATIVE_RUNS.items():
        spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": k, "parallel_drafting": par}
        if adaptive:
            spec["adaptive"] = adaptive
        if only is not None and label != only:
            continue
        switches = {"propose_verified_only": True} if propose_verified_only else {}
        rows, _, ms = run(d, spec, RATES[:k], concurrency, repeat, **switches)
        result["runs"][label] = rows
        result.setdefault("ms_per_token_batch1", {})[label] = ms
        save()
    if hf:
        try:
            result["hf_static_compile"] = hf_static_compile(d)
            result["ours_vs_hf_batch1"] = result["hf_static_compile"]["decode_ms_batch1"] / step_ms
        except Exception as e:  # noqa: BLE001 - the baseline failing must not lose the engine's numbers
            result["hf_static_compile"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        save()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--hf", action="store_true", help="also time transformers (static cache + compile) at batch 1")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--gemv", action="store_true",
                    help="also time plain decoding with decode_gemv (the rows 'none-gemv', decode_vs_floor_gemv)")
    ap.add_argument("--repeat", type=int, default=1, help="time each concurrency's wave this many times (>= 1)")
    ap.add_argument("--only", choices=sorted(SPECULATIVE_RUNS),
                    help="the speculative run of this label only; plain decoding then at concurrency 1 only, for "
                         "the floor")
    ap.add_argument("--propose-verified-only", action="store_true",
                    help="the adaptive engine's drafter proposes only the drafts its step's K verifies "
                         "(EngineConfig.propose_verified_only)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1 (got {args.repeat})")
    sys.exit(main(args.out, args.hf, [int(c) for c in args.concurrency.split(",")], args.gemv, args.repeat,
                  args.only, args.propose_verified_only))
