"""How fragile bf16 greedy decoding of the testbed model is: peagle (full recompute) vs Hugging Face generate with
and without its KV cache, on 8 MT-Bench first turns, 48 tokens. Runs on the CPU or a GPU.

Usage: python scripts/device/bf16_fragility.py CKPT_DIR
"""
import torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from verify_target import greedy_peagle
from transformers import AutoModelForCausalLM
from peagle.datasets import load_prompts
from peagle.models.loader import load_model, load_tokenizer
ck = sys.argv[1]; tok = load_tokenizer(ck)
prompts = [tok.encode_chat(p.messages) for p in load_prompts("mtbench", limit=8)]
ours = load_model(ck, dtype=torch.bfloat16); ref = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16).eval()
same_cache = same_nocache = 0
with torch.inference_mode():
    for ids in prompts:
        g = greedy_peagle(ours, ids, 48)
        t = torch.tensor([ids])
        a = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        b = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0, use_cache=False)[0, len(ids):].tolist()
        same_cache += g == a; same_nocache += g == b
        print(g == a, g == b, a == b, flush=True)
print("identical to HF with cache", same_cache, "/8; to HF recompute", same_nocache, "/8")
