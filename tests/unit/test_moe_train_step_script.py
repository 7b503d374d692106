"""scripts/device/moe_train_step.py on the CPU with a tiny Qwen3-MoE config: `peagle train --load-format dummy` runs
from the config alone, and the JSON summarises the logged intervals (the first, compilation's, left out of the rate)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_training_trainer import write_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device" / "moe_train_step.py"


def test_summarises_a_dummy_target_run(tiny_hf_checkpoint, tmp_path):
    checkpoint = tiny_hf_checkpoint("qwen3_moe", num_layers=4)
    data = write_dataset(tmp_path / "data", checkpoint)
    out = tmp_path / "train.json"
    run = subprocess.run([sys.executable, str(SCRIPT), str(checkpoint / "config.json"), str(out), "--tokenizer",
                          str(checkpoint), "--data", str(data), "--steps", "25", "--max-length", "64", "--",
                          "--aux-layer-ids", "1", "2", "3", "--num-layers", "1", "--k-train", "3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["rc"] == 0 and result["steps"] == 25 and "--load-format" in result["command"]
    assert [i["step"] for i in result["intervals"]] == [10, 20, 25]  # one row per logged interval, its last step
    steady = [i["tokens_per_s"] for i in result["intervals"][1:]]
    assert result["tokens_per_s"] == sum(steady) / len(steady)


def test_an_unknown_shape_is_refused(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "qwen9", str(tmp_path / "o.json"), "--tokenizer", ".",
                          "--data", "."], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "expected one of gpt-oss-20b, qwen3-30b-a3b or a config.json" in run.stderr
