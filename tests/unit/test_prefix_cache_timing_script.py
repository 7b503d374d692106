"""scripts/device/prefix_cache_timing.py on the CPU: it runs both settings on random weights, the cache takes the
shared full blocks, and the first tokens agree (the timings themselves mean nothing here)."""

from __future__ import annotations

import json

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "eos_token_id": 0}


def test_prefix_cache_timing_runs_both_settings(tmp_path, repo_script, capsys):
    script = repo_script("device/prefix_cache_timing")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "r.json"
    spec = '{"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3, "parallel_drafting": true}'
    assert script.main([str(tmp_path / "m"), str(out), "--dummy", "--shared", "40", "--own", "5", "--prompts", "3",
                        "--speculative-config", spec]) == 0
    result = json.loads(out.read_text())
    off, on = result["rows"]
    # Blocks of 16: blocks 0 and 1 and the token after them are shared; block 2 holds each prompt's own tokens.
    assert (off["cached_tokens_median"], on["cached_tokens_median"]) == (0, 32)
    assert result["first_tokens_equal"] and len(on["first_tokens"]) == 3
    assert "off / on at p50" in capsys.readouterr().out
