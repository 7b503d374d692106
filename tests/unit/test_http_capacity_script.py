"""scripts/device/http_capacity.py on the CPU: `peagle serve` runs in a process of its own per source tree and stream
interval, the raw-socket clients count every request's tokens, and the rows come back (the rates mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path


def test_http_capacity_measures_each_tree_and_interval(tiny_hf_checkpoint, tmp_path, repo_script):
    script = repo_script("device/http_capacity")
    src = Path(__file__).parents[2] / "src"
    out = tmp_path / "r.json"
    assert script.main([str(tiny_hf_checkpoint("llama", num_layers=2)), str(out), "--src", f"a={src}",
                        "--dummy", "--concurrency", "2", "--stream-interval", "1,4", "--seconds", "1",
                        "--max-tokens", "12", "--engine-modes", "thread,process"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["src"], r["engine"], r["stream_interval"], r["concurrency"]) for r in rows] == [
        ("a", "thread", 1, 2), ("a", "process", 1, 2), ("a", "thread", 4, 2), ("a", "process", 4, 2)]
    assert all(r["tokens_per_s"] > 0 and r["server_cpu_us_per_token"] > 0 for r in rows)
    # the engine's steps run in the server's process, or in the child it spawned
    assert [r["engine_process_cpu_per_s"] > 0 for r in rows] == [False, True, False, True]
