"""scripts/plot_training.py: the curves it reads from a training log, with and without --eval-data rows."""

import gzip
import json


def test_curve_reads_the_held_out_and_the_eval_data_walks(tmp_path, repo_script):
    curve = repo_script("plot_training").curve
    rows = [{"kind": "train", "step": 1, "step_s": 30.0}, {"kind": "train", "step": 2, "step_s": 30.0},
            {"kind": "eval", "step": 2, "walk_al": {"7": 2.0}, "sim_al": {"7": 2.5},
             "eval_data": {"walk_al": {"7": 1.7}}},
            {"kind": "train", "step": 3, "step_s": 60.0},
            {"kind": "eval", "step": 3, "eval_data": {"walk_al": {"7": 1.8}}}]  # --eval-fraction 0: eval_data only
    log = tmp_path / "train_log.jsonl.gz"
    log.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    minutes, walk, simulated, evaluation = curve(log, 7)
    assert (minutes, walk, simulated) == ([1.0], [2.0], [2.5])  # evaluation time is not training time
    assert evaluation == [(1.0, 1.7), (2.0, 1.8)]
    assert curve(log, 3) == ([], [], [], [])
