"""scripts/server_overhead.py on the CPU: the stand-in engine's server answers its raw-socket clients, every request
is counted through its usage chunk, and a row per stream interval comes back (the rates mean nothing here)."""

from __future__ import annotations

import json


def test_server_overhead_measures_each_interval(tiny_hf_checkpoint, tmp_path, repo_script, capsys):
    script = repo_script("server_overhead")
    out = tmp_path / "r.json"
    assert script.main(["--tokenizer", str(tiny_hf_checkpoint("llama", num_layers=4)), "--concurrency", "3",
                        "--seconds", "1", "--max-tokens", "20", "--stream-interval", "1,7", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["stream_interval"] for r in rows] == [1, 7]
    assert all(r["tokens_per_s"] > 0 and r["chunks_per_s"] > 0 and r["server_cpu_us_per_token"] > 0 for r in rows)
    # 20 tokens in steps of 3: at most 7 text chunks at interval 1 (fewer when outputs queue up), at most 3 at
    # interval 7 (3 at once, then 9 when 7 have gathered, then the last 8 as it ends)
    tokens_per_chunk = [r["tokens_per_s"] / r["chunks_per_s"] for r in rows]
    assert tokens_per_chunk[0] >= 20 / 7 - 1e-9 and tokens_per_chunk[1] >= 20 / 3 - 1e-9
    assert "interval   7" in capsys.readouterr().out
    assert all(r["engine"] == "thread" and r["client_cpu_per_s"] > 0 and r["engine_cpu_per_s"] == 0 for r in rows)


def test_server_overhead_measures_the_engine_process_and_api_servers(tiny_hf_checkpoint, tmp_path, repo_script):
    script = repo_script("server_overhead")
    out = tmp_path / "r.json"
    assert script.main(["--tokenizer", str(tiny_hf_checkpoint("llama", num_layers=4)), "--concurrency", "4",
                        "--seconds", "1", "--max-tokens", "20", "--engine", "process,process2", "--out",
                        str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["engine"] for r in rows] == ["process", "process2"]
    # the stand-in sleeps through its steps, so its process uses little CPU, but some
    assert all(r["tokens_per_s"] > 0 and r["server_cpu_per_s"] > 0 and r["engine_cpu_per_s"] > 0 for r in rows)
