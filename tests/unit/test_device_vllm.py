"""vLLM's staging for the GPU machine, without a GPU or the network: the folders scripts/device/vllm_wheels.py packs,
and the vllm_part / vllm_stage side of scripts/device/stages.py that gathers, checks, joins and installs them."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[2] / "scripts" / "device"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"device_{name}", DEVICE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


stages, wheels = load("stages"), load("vllm_wheels")


def make_wheel(dest: Path, name: str, version: str = "1.0", requires: tuple[str, ...] = (), padding: int = 0) -> Path:
    """A pure-Python wheel pip installs: NAME/__init__.py (with PADDING bytes of comment), its dist-info."""
    path = dest / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n#{'x' * padding}\n",
             f"{info}/METADATA": "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                                            *(f"Requires-Dist: {r}" for r in requires)]) + "\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def staged(tmp_path: Path, budget: int = 4000) -> tuple[dict, list[Path]]:
    """A stand-in vLLM wheel (in parts) and two wheels beside it, packed into .vllm_* folders as stage_local.sh does."""
    dl = tmp_path / "dl"
    dl.mkdir()
    vllm = make_wheel(dl, "fakevllm", requires=("fakedep>=1",), padding=6000)
    deps = [make_wheel(dl, "fakedep"), make_wheel(dl, "otherdep", padding=500)]
    manifest = {"vllm": {"version": "0.25.0", "file": vllm.name, "size": vllm.stat().st_size,
                         "sha256": wheels.sha256(vllm), "parts": wheels.cut(vllm, 3000, dl)},
                "deps": [{"name": d.name.split("-")[0], "file": d.name, "size": d.stat().st_size,
                          "sha256": wheels.sha256(d)} for d in deps]}
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    return manifest, wheels.pack(manifest, dl, checkout, budget)


def test_the_folders_hold_a_part_each_and_every_wheel_once_within_the_budget(tmp_path):
    manifest, folders = staged(tmp_path)
    assert [f.name for f in folders] == [".vllm_a", ".vllm_b", ".vllm_c"]
    held = [p.name for f in folders for p in f.iterdir() if p.name != "manifest.json"]
    names = [p["file"] for p in manifest["vllm"]["parts"]] + [d["file"] for d in manifest["deps"]]
    assert sorted(held) == sorted(names)
    for folder in folders:
        assert sum(p.stat().st_size for p in folder.iterdir()) <= 4000
        assert len([p for p in folder.iterdir() if p.name.startswith("vllm.whl.part-")]) == 1
        assert json.loads((folder / "manifest.json").read_text()) == manifest


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """The GPU machine's side: $W, /tmp/vllm-site and the checkout the calls run in, all under tmp_path."""
    manifest, folders = staged(tmp_path)
    monkeypatch.setattr(stages, "W", tmp_path / "w")
    monkeypatch.setattr(stages, "VLLM_SITE", str(tmp_path / "site"))
    monkeypatch.setenv("PYTHON", sys.executable)
    return manifest, folders, tmp_path / "checkout"


def carry(checkout: Path, folder: Path, monkeypatch) -> None:
    """One call's working tree: the checkout with only FOLDER of the .vllm_* folders in it."""
    for other in checkout.glob(".vllm_*"):
        other.rename(checkout.parent / f"away{other.name}")
    (checkout.parent / f"away{folder.name}").rename(checkout / folder.name)
    monkeypatch.chdir(checkout)


def test_the_parts_come_a_call_each_then_are_checked_joined_and_installed(machine, monkeypatch, capsys):
    manifest, folders, checkout = machine
    for folder in folders[:-1]:
        carry(checkout, folder, monkeypatch)
        stages.vllm_part()
    assert "still to come" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        stages.vllm_install(stages.vllm_gather())
    assert e.value.code == 3  # a file still missing
    carry(checkout, folders[-1], monkeypatch)
    stages.vllm_install(stages.vllm_gather())
    site = Path(stages.VLLM_SITE)
    assert (site / "fakevllm" / "__init__.py").is_file() and (site / "fakedep" / "__init__.py").is_file()
    assert (site / ".done").is_file() and not (stages.W / manifest["vllm"]["file"]).exists()


def test_a_file_that_does_not_match_its_sha256_is_refused(machine, monkeypatch):
    manifest, folders, checkout = machine
    for folder in folders:
        carry(checkout, folder, monkeypatch)
        stages.vllm_gather()
    part = stages.W / "vllm-parts" / manifest["vllm"]["parts"][1]["file"]
    part.write_bytes(part.read_bytes()[:-1] + b"?")
    with pytest.raises(SystemExit) as e:
        stages.vllm_install(stages.vllm_gather())
    assert e.value.code == 6 and not Path(stages.VLLM_SITE, ".done").exists()


def test_unmet_requirements_of_the_staged_wheels_are_named(tmp_path):
    check = load("vllm_check")
    site = tmp_path / "site"
    dl = tmp_path / "dl"
    dl.mkdir()
    wheel = make_wheel(dl, "fakevllm", requires=("no-such-package>=1", "packaging>=1", "packaging<1; extra == 'x'"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    assert check.unmet_requirements(str(site)) == [
        {"of": "fakevllm", "needs": "no-such-package>=1", "name": "no-such-package", "found": None}]


def test_the_parts_are_of_equal_size_and_carry_their_sums(tmp_path):
    blob = tmp_path / "w.whl"
    blob.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    parts = wheels.cut(blob, 3414, tmp_path)  # as vllm_wheels.main sizes them: ceil(10240 / 3) = 3414
    assert [p["size"] for p in parts] == [3414, 3414, 3412]
    joined = b"".join((tmp_path / p["file"]).read_bytes() for p in parts)
    assert joined == blob.read_bytes()
    assert all(p["sha256"] == hashlib.sha256((tmp_path / p["file"]).read_bytes()).hexdigest() for p in parts)


def test_vllm_sanity_times_vllms_generate_per_batch_size(tmp_path):
    import subprocess

    fake = Path(__file__).parent / "fake_vllm"
    out = tmp_path / "generate.json"
    done = subprocess.run([sys.executable, str(DEVICE / "vllm_sanity.py"), "model-dir", str(out), "--site", str(fake),
                           "--prompt-tokens", "5", "--max-tokens", "4", "--batches", "1:2,3:6"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["vllm"] == "0.25.0+fake" and result["max_tokens"] == 4 and result["batches"] == "1:2,3:6"
    assert set(result["tokens_per_s"]) == {"1", "3"} and all(rate > 0 for rate in result["tokens_per_s"].values())


def test_vllm_bench_runs_a_bench_a_method_with_vllm_kept_off_flashinfer(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stages, "W", tmp_path / "w")
    monkeypatch.setattr(stages, "OUT", tmp_path / "out")
    monkeypatch.setattr(stages, "need_model", lambda *a, **k: None)
    monkeypatch.setattr(stages, "link_heads", lambda *a, **k: None)
    monkeypatch.setattr(stages, "run", lambda *a, **k: 0)
    monkeypatch.setattr(stages, "shown", lambda cmd, **k: calls.append(([str(c) for c in cmd], k.get("env"))))
    monkeypatch.setenv("VB_METHODS", "none peagle")
    stages.vllm_bench()
    benches = [(cmd, env) for cmd, env in calls if "--vllm-baselines" in cmd]
    assert [cmd[cmd.index("--methods") + 1] for cmd, _ in benches] == ["none", "peagle"]
    peagle = benches[1][0]
    assert peagle[peagle.index("--k") + 1] == "7" and peagle[peagle.index("--draft-peagle") + 1].endswith("peagle")
    # vLLM 0.25's sampler imports FlashInfer, which the GPU image lacks (run 34): every vLLM process runs without it.
    assert all(env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" for _, env in benches)
    assert stages.vllm_env()["VLLM_USE_FLASHINFER_SAMPLER"] == "0"

