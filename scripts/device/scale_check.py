"""Device check at real size: Llama-3.1-8B-shaped random weights (no checkpoint), decode speed vs the bandwidth floor.

Usage: python scripts/device/scale_check.py OUT.json
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from peagle import LLM, SamplingParams

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "eos_token_id": 128009}
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


def run(d, spec, rates, conc):
    llm = LLM(model=d, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=max(conc),
              speculative_config=spec, synthetic_acceptance=rates)
    rows = []
    for c in conc:
        prompts = [[1000 + i, 2000, 3000 + i] for i in range(c)]
        p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        # Warm this concurrency's shapes (Triton variants compile on first use), then time.
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, p, use_tqdm=False)
        wall = time.perf_counter() - t
        rows.append({"concurrency": c, "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall})
    weights = sum(p.numel() * p.element_size() for p in llm.engine.target.parameters())
    del llm
    torch.cuda.empty_cache()
    return rows, weights


def main(out: str) -> int:
    d = tempfile.mkdtemp()
    (Path(d) / "config.json").write_text(json.dumps(LLAMA_8B))
    bw = copy_bandwidth()
    result = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "synthetic_rates": RATES, "runs": {}}
    none, weights = run(d, None, None, [1, 8, 64])
    result["weight_bytes"] = weights
    result["floor_ms"] = 1e3 * weights / bw
    result["runs"]["none"] = none
    for name, par in (("eagle3", False), ("peagle", True)):
        spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 7 if par else 3,
                "parallel_drafting": par}
        result["runs"][name] = run(d, spec, RATES if par else RATES[:3], [1, 8, 64])[0]
    b1 = none[0]["tokens_per_s"]
    result["decode_ms_batch1"] = 1e3 / b1
    print(json.dumps(result))
    Path(out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
