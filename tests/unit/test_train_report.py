"""`peagle train-report`: training logs side by side (a table of each run's last evaluation) and the walk over
training time."""

import gzip
import json

import pytest

from peagle.cli import main
from peagle.training.report import curve, default_k, load_run


def _write(path, rows):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _log(walk7, eval7, tokens_per_s=1000.0):
    # train rows every other step (--log-every 2): each row's step_s covers the steps since the row before it
    return [
        {"kind": "train", "step": 2, "step_s": 30.0, "tokens_per_s": tokens_per_s},
        {"kind": "eval", "step": 2, "acc": [0.5, 0.25], "walk_al": {"3": 1.5, "7": 1.6}, "sim_al": {"7": 2.0},
         "eval_data": {"walk_al": {"7": 1.4}}},
        {"kind": "schedule", "step": 3, "total_steps": 4},
        {"kind": "train", "step": 4, "step_s": 60.0, "tokens_per_s": tokens_per_s * 3},
        {"kind": "eval", "step": 4, "acc": [0.8, 0.6], "walk_al": {"3": 2.0, "7": walk7}, "sim_al": {"7": 3.0},
         "eval_data": {"walk_al": {"7": eval7}}},
    ]


def test_curves_count_training_time_only_and_read_each_split(tmp_path):
    run = load_run(f"a={_write(tmp_path / 'log.jsonl.gz', _log(2.5, 2.2))}")
    assert run.label == "a"
    assert run.minutes_at(2) == pytest.approx(1.0)  # 2 steps x 30 s
    assert run.minutes_at(4) == pytest.approx(3.0)  # + 2 steps x 60 s; evaluations take no training time
    assert curve(run, 7, "walk") == ([pytest.approx(1.0), pytest.approx(3.0)], [1.6, 2.5])
    assert curve(run, 7, "eval_data")[1] == [1.4, 2.2]
    assert curve(run, 7, "simulated")[1] == [2.0, 3.0]
    assert curve(run, 5, "walk") == ([], [])


def test_an_eval_data_only_log_and_the_default_k(tmp_path):
    rows = [{"kind": "train", "step": 1, "step_s": 6.0},
            {"kind": "eval", "step": 1, "eval_data": {"walk_al": {"5": 1.9, "6": 2.0}}}]  # --eval-fraction 0
    (tmp_path / "solo").mkdir()
    _write(tmp_path / "solo" / "train_log.jsonl", rows)
    run = load_run(str(tmp_path / "solo"))
    assert run.label == "solo"  # the training directory's name
    assert default_k([run]) == 6  # no K=7 walked: the deepest one
    assert curve(run, 6, "walk") == ([], []) and curve(run, 6, "eval_data")[1] == [2.0]
    other = load_run(f"b={_write(tmp_path / 'b.jsonl', _log(2.5, 2.2))}")
    assert default_k([other]) == 7
    with pytest.raises(ValueError, match="share no walk depth"):
        default_k([run, load_run(f"c={_write(tmp_path / 'c.jsonl', [rows[0], {'kind': 'eval', 'step': 1}])}")])


def test_cli_prints_one_row_per_run_and_draws_the_plot(tmp_path, capsys):
    base = tmp_path / "base"
    base.mkdir()
    _write(base / "train_log.jsonl", _log(2.5, 2.2))
    other = _write(tmp_path / "other.jsonl.gz", _log(2.75, 2.4, tokens_per_s=2000.0))
    png = tmp_path / "plots" / "ab.png"
    assert main(["train-report", str(base), f"variant={other}", "--plot", str(png), "--simulated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "walk AL@7 held-out" in lines[0] and "walk AL@7 --eval-data" in lines[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:4]}
    # last evaluation: step 4 after 3.0 minutes; median of 1000 and 3000 tokens/s; accuracy by depth; the walks
    assert rows["base"] == "| base | 4 | 3.0 | 2.0K | 0.800 / 0.600 | 2.500 | 2.200 |"
    assert rows["variant"] == "| variant | 4 | 3.0 | 4.0K | 0.800 / 0.600 | 2.750 | 2.400 |"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert main(["train-report", str(base), "--k", "3"]) == 0
    assert "| base | 4 | 3.0 | 2.0K | 0.800 / 0.600 | 2.000 | - |" in capsys.readouterr().out


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["train-report", str(tmp_path / "missing.jsonl")]) == 1
    assert "no training log" in capsys.readouterr().err
    no_eval = _write(tmp_path / "no_eval.jsonl", [{"kind": "train", "step": 1, "step_s": 1.0}])
    assert main(["train-report", str(no_eval)]) == 1
    assert "no evaluation rows" in capsys.readouterr().err
    log = _write(tmp_path / "log.jsonl", _log(2.5, 2.2))
    assert main(["train-report", str(log), "--k", "9"]) == 1
    assert "has no walk at K=9" in capsys.readouterr().err
    assert main(["train-report", str(log), "--k", "0"]) == 1
    assert "--k must be at least 1, got 0" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"kind": "eval"\n')
    assert main(["train-report", str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:1: not a JSON line" in capsys.readouterr().err
