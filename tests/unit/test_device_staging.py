"""The testbed target's GGUF and the trained heads in parts sized to a call's room (scripts/device/stages.py's home side,
which scripts/device/stage_local.sh runs), and their gathering across calls on the GPU machine (stage_a, need_model),
checked without a GPU; the gpu_tests stage's log line by line and its time limit."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES_PY = REPO / "scripts" / "device" / "stages.py"


def load_stages():
    spec = importlib.util.spec_from_file_location("device_stages_staging", STAGES_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


stages = load_stages()
KIB = 1024


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A stand-in GGUF (300 KiB) cut into .stage_* folders at home, and the GPU machine's $W; conversions recorded
    instead of run. Returns (the GGUF's bytes, the folders, the checkout the calls run in, the conversions)."""
    data = os.urandom(300 * KIB)
    gguf = tmp_path / "dl" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(data)
    home = tmp_path / "home"
    home.mkdir()
    folders = stages.gguf_split(gguf, stages.SLACK + 110 * KIB, home)  # 110 KiB a part: three parts
    monkeypatch.setattr(stages, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(stages, "W", tmp_path / "w")
    converted: list[list] = []

    def run(cmd, *, check=True, **kw):
        if "convert" in map(str, cmd):
            converted.append(cmd)
            (stages.W / "smollm2").mkdir(parents=True, exist_ok=True)
            (stages.W / "smollm2" / "config.json").write_text("{}")
            return 0
        return subprocess.run([str(c) for c in cmd], check=check, **kw).returncode

    monkeypatch.setattr(stages, "run", run)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    return data, folders, checkout, converted


def carry(checkout: Path, *folders: Path) -> None:
    """One call's working tree: the checkout with only FOLDERS of the staged folders in it (copies)."""
    for old in [*checkout.glob(".stage_*"), *checkout.glob(".hp_*")]:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for folder in folders:
        (checkout / folder.name).mkdir()
        for f in folder.iterdir():
            (checkout / folder.name / f.name).write_bytes(f.read_bytes())


def test_the_gguf_is_cut_into_equal_parts_that_fit_the_room_each_with_the_manifest(machine):
    data, folders, _, _ = machine
    assert [f.name for f in folders] == [".stage_a", ".stage_b", ".stage_c"]
    manifest = json.loads((folders[0] / stages.GGUF_MANIFEST).read_text())
    assert manifest["size"] == len(data) and manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert [p["file"] for p in manifest["parts"]] == ["gguf.part.aa", "gguf.part.ab", "gguf.part.ac"]
    assert [p["folder"] for p in manifest["parts"]] == [f.name for f in folders]
    sizes = [p["size"] for p in manifest["parts"]]
    assert max(sizes) - min(sizes) <= 2 and max(sizes) <= 110 * KIB
    assert b"".join((f / p["file"]).read_bytes() for f, p in zip(folders, manifest["parts"])) == data
    for folder in folders:
        assert json.loads((folder / stages.GGUF_MANIFEST).read_text()) == manifest
        assert len(list(folder.glob("gguf.part.*"))) == 1 and len(list(folder.iterdir())) == 2


def test_a_new_split_replaces_the_old_parts_and_leaves_other_files(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(200 * KIB))
    home = tmp_path / "home"
    home.mkdir()
    assert len(stages.gguf_split(gguf, stages.SLACK + 50 * KIB, home)) == 4
    (home / ".stage_d" / "data").mkdir()  # something else in a folder of that name stays
    assert len(stages.gguf_split(gguf, stages.SLACK + 100 * KIB, home)) == 2
    assert sorted(p.name for p in home.glob(".stage_*")) == [".stage_a", ".stage_b", ".stage_d"]
    assert [p.name for p in (home / ".stage_d").iterdir()] == ["data"]


def test_the_parts_come_a_call_each_then_are_joined_checked_and_converted(machine, capsys):
    data, folders, checkout, converted = machine
    carry(checkout, folders[0])
    stages.stage_a()
    assert "1 of 3 parts here; still to come: .stage_b, .stage_c" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        stages.need_model()  # a stage that needs the model before the parts are all here
    assert e.value.code == 3 and not converted
    assert "still to come: .stage_b, .stage_c" in capsys.readouterr().out
    carry(checkout, folders[2])  # any order
    stages.stage_a()
    assert "2 of 3 parts here; still to come: .stage_b" in capsys.readouterr().out
    carry(checkout, folders[1])
    stages.stage_a()
    assert (stages.W / stages.GGUF_FILE).read_bytes() == data
    assert not (stages.W / stages.GGUF_PARTS).exists() and len(converted) == 1
    assert "joined from 3 parts and checked" in capsys.readouterr().out
    stages.stage_a()  # again: the target is here already
    assert "here already" in capsys.readouterr().out and len(converted) == 1


def test_the_last_part_can_come_with_the_stage_that_needs_the_model(machine):
    data, folders, checkout, converted = machine
    for folder in folders[:2]:
        carry(checkout, folder)
        stages.stage_a()
    carry(checkout)
    assert stages.need_model(must=False) is False  # heads_in without the last part: the target not yet
    carry(checkout, folders[2])
    assert stages.need_model() is True
    assert (stages.W / stages.GGUF_FILE).read_bytes() == data and len(converted) == 1


def test_a_corrupted_part_is_refused_when_carried(machine, capsys):
    _, folders, checkout, converted = machine
    carry(checkout, folders[1])
    part = checkout / ".stage_b" / "gguf.part.ab"
    part.write_bytes(part.read_bytes()[:-1] + b"?")
    with pytest.raises(SystemExit) as e:
        stages.stage_a()
    assert e.value.code == 6 and "does not match gguf-manifest.json's sha256" in capsys.readouterr().out
    assert not (stages.W / stages.GGUF_PARTS / "gguf.part.ab").exists()


def test_a_part_spoiled_on_the_machine_is_refused_at_the_join(machine, capsys):
    _, folders, checkout, converted = machine
    for folder in folders[:2]:
        carry(checkout, folder)
        stages.stage_a()
    part = stages.W / stages.GGUF_PARTS / "gguf.part.aa"
    part.write_bytes(b"?" + part.read_bytes()[1:])
    carry(checkout, folders[2])
    with pytest.raises(SystemExit) as e:
        stages.stage_a()
    assert e.value.code == 6 and "gguf.part.aa does not match" in capsys.readouterr().out
    assert not (stages.W / stages.GGUF_FILE).exists() and not converted


def test_a_whole_that_is_not_the_testbeds_gguf_is_refused(machine, monkeypatch, capsys):
    _, folders, checkout, converted = machine
    monkeypatch.setattr(stages, "GGUF_SHA256", "0" * 64)
    for folder in folders[:-1]:
        carry(checkout, folder)
        stages.stage_a()
    carry(checkout, folders[-1])
    with pytest.raises(SystemExit) as e:
        stages.stage_a()
    assert e.value.code == 6 and "do not match the sha256" in capsys.readouterr().out
    assert not (stages.W / stages.GGUF_FILE).exists() and not list(stages.W.glob(".*.tmp")) and not converted


def test_a_part_of_another_split_is_refused(machine, tmp_path, capsys):
    _, folders, checkout, _ = machine
    carry(checkout, folders[0])
    stages.stage_a()
    other = tmp_path / "other"
    other.mkdir()
    gguf = tmp_path / "dl" / "model.gguf"
    again = stages.gguf_split(gguf, stages.SLACK + 160 * KIB, other)  # two parts: another manifest
    carry(checkout, again[1])
    with pytest.raises(SystemExit) as e:
        stages.stage_a()
    assert e.value.code == 6 and "of another split" in capsys.readouterr().out


def test_stage_a_without_a_part_and_need_model_before_stage_a_are_refused(machine, capsys):
    _, _, checkout, _ = machine
    carry(checkout)
    with pytest.raises(SystemExit) as e:
        stages.stage_a()
    assert e.value.code == 2 and "stage_local.sh wheels" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        stages.need_model()
    assert e.value.code == 3 and "stage_a has not run on this machine" in capsys.readouterr().out


def test_fill_keeps_the_order_and_the_room():
    assert stages.fill([15, 15, 15, 5, 15, 15, 5], 43) == [[0, 1], [2, 3, 4], [5, 6]]
    assert stages.fill([15, 15, 5, 15], 45) == [[0, 1, 2], [3]]
    with pytest.raises(SystemExit, match="does not fit"):
        stages.fill([10, 50], 43)


def heads_dir(tmp_path: Path, sizes: dict[str, list[int]]) -> Path:
    """heads_out's folder as it comes home: manifest.json and HEAD.part-NNN files of SIZES (KiB)."""
    d = tmp_path / "heads"
    d.mkdir()
    heads = {}
    for head, parts in sizes.items():
        heads[head] = {"parts": []}
        for i, kib in enumerate(parts):
            name = f"{head}.part-{i:03d}"
            (d / name).write_bytes(os.urandom(kib * KIB))
            heads[head]["parts"].append({"file": name, "sha256": "-"})
    (d / "manifest.json").write_text(json.dumps({"format": 1, "heads": heads}))
    return d


def test_heads_are_filed_into_as_few_folders_as_the_room_allows(tmp_path):
    d = heads_dir(tmp_path, {"peagle": [15, 15, 15, 5], "eagle3": [15, 15, 5]})
    into = tmp_path / "checkout"
    into.mkdir()
    (into / ".hp_z").mkdir()  # an earlier filing's folder goes
    room = stages.SLACK + 45 * KIB
    folders = stages.file_heads([d], room, into)
    held = [sorted(p.name for p in f.iterdir() if p.name != "manifest.json") for f in folders]
    assert [f.name for f in folders] == [".hp_a", ".hp_b", ".hp_c"]
    assert held == [["peagle.part-000", "peagle.part-001"], ["eagle3.part-000", "peagle.part-002", "peagle.part-003"],
                    ["eagle3.part-001", "eagle3.part-002"]]
    for f in folders:
        assert (f / "manifest.json").read_bytes() == (d / "manifest.json").read_bytes()
        assert sum(p.stat().st_size for p in f.iterdir()) <= room
    assert not (into / ".hp_z").exists()


def test_heads_with_a_part_missing_are_refused(tmp_path):
    d = heads_dir(tmp_path, {"peagle": [4, 4]})
    (d / "peagle.part-001").unlink()
    with pytest.raises(SystemExit, match="1 of 2 parts missing"):
        stages.file_heads([d], stages.SLACK + 45 * KIB, tmp_path)


def test_the_plan_names_a_call_a_folder(tmp_path):
    mib = stages.MIB
    d = heads_dir(tmp_path, {"peagle": [15 * 1024] * 3 + [5 * 1024], "eagle3": [15 * 1024] * 2 + [5 * 1024]})
    lines = stages.plan(43 * mib, 18 * mib, 5 * mib, [d])
    calls = [line.split()[1:4] for line in lines if line.lstrip()[:1].isdigit()]
    assert calls == [["stage_a", "carry", ".stage_a"], ["stage_a", "carry", ".stage_b"],
                     ["stage_a", "carry", ".stage_c"], ["heads_in", "carry", ".hp_a"],
                     ["heads_in", "carry", ".hp_b"], ["heads_in", "carry", ".hp_c"]]
    assert ".stage_a .whl" in lines[2] and "joined, checked, converted" in lines[4]
    assert stages.gguf_parts_for(43 * mib, 5 * mib) == 3 and stages.gguf_parts_for(60 * mib, 5 * mib) == 2


def test_gpu_tests_logs_a_line_a_test_and_stops_at_its_time_limit(tmp_path):
    tests = tmp_path / "gputests"
    tests.mkdir()
    (tests / "test_slow.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                        "def test_slow():\n    time.sleep(60)\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for d in ("scripts", "src"):
        (cwd / d).symlink_to(REPO / d)
    out = tmp_path / "out"
    env = {**os.environ, "PEAGLE_WORK": str(tmp_path / "work"), "OUT": str(out), "PYTHON": sys.executable,
           "GPU_TESTS": str(tests), "GPU_TESTS_TIMEOUT": "8"}
    r = subprocess.run(["bash", "scripts/device/run.sh", "gpu_tests"], cwd=cwd, env=env, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 124, r.stdout + r.stderr
    log = (out / "gpu_tests.log").read_text()
    assert "test_slow.py::test_quick PASSED" in log and "slowest" in log and "KeyboardInterrupt" in log
    assert "GPU_TESTS_TIMEOUT (8 s) reached" in r.stdout
