"""The trainer: exact resume after SIGTERM, data parallelism equals one process, the CLI end to end, errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import peagle
from peagle.cli import build_parser, main
from peagle.drafters import load_drafter
from peagle.models.config import ModelConfig
from peagle.models.loader import load_tokenizer
from peagle.training.cli import train_config
from peagle.training.config import TrainConfig
from peagle.training.data import Document, Manifest, tokenizer_fingerprint, write_shard
from peagle.training.distributed import DistContext
from peagle.training.forward import StepStats
from peagle.training.objectives import EvalStats
from peagle.training.optimizers import Muon, muon_split
from peagle.training.teacher import run_target
from peagle.training.trainer import FINAL, LOG_FILE, build_trainer, fitted_total_steps, lr_factor


def write_dataset(out: Path, checkpoint: Path, num_docs: int = 24, seed: int = 0) -> Path:
    """Documents with a learnable pattern (arithmetic runs of token ids), prompt tokens masked out."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(num_docs):
        n = int(torch.randint(12, 40, (1,), generator=gen))
        prompt = int(torch.randint(2, 8, (1,), generator=gen))
        start = int(torch.randint(0, 300, (1,), generator=gen))
        docs.append(Document((torch.arange(n) * 3 + start) % 390 + 6, torch.arange(n) >= prompt))
    out.mkdir(parents=True)
    write_shard(out / "shard-00000.safetensors", docs)
    tokenizer = load_tokenizer(checkpoint)
    Manifest(tokenizer_fingerprint(tokenizer), ModelConfig.from_dir(checkpoint).vocab_size, "tiny", {},
             [{"file": "shard-00000.safetensors", "first_prompt": 0, "num_prompts": num_docs,
               "num_documents": num_docs, "num_tokens": sum(len(d) for d in docs)}]).write(out)
    return out


@pytest.fixture(scope="module")
def setup(tiny_hf_checkpoint, tmp_path_factory):
    checkpoint = tiny_hf_checkpoint("llama", num_layers=6)
    data = write_dataset(tmp_path_factory.mktemp("data") / "data", checkpoint)
    return checkpoint, data


def _args(checkpoint, data, out, *extra):
    return ["train", "--target", str(checkpoint), "--data", str(data), "--out", str(out), "--method", "peagle",
            "--num-layers", "1", "--k-train", "3", "--max-length", "64", "--lr", "3e-3", "--warmup-steps", "1",
            "--eval-fraction", "0", "--aux-layer-ids", "1", "3", "4", *extra]


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in lines if r["kind"] == "train"]


def _config(checkpoint, data, out, *extra) -> TrainConfig:
    from peagle.cli import build_parser

    return train_config(build_parser().parse_args(_args(checkpoint, data, out, *extra)))


@pytest.fixture
def one_thread():
    # Comparisons between runs need one CPU thread: the BLAS may split a matmul differently when it picks another
    # thread count under load, which changes the last bits (seen as a flaky first-step loss). The torchrun
    # processes of the DDP test run with one thread too (OMP_NUM_THREADS=1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sigterm_saves_and_resume_repeats_the_uninterrupted_run(setup, tmp_path, one_thread):
    checkpoint, data = setup
    common = ("--steps", "4", "--num-segments", "2", "--save-every", "100", "--batch-size", "2")
    cpu = DistContext(0, 1, torch.device("cpu"))
    assert build_trainer(_config(checkpoint, data, tmp_path / "a", *common), cpu).train() == 0

    trainer = build_trainer(_config(checkpoint, data, tmp_path / "b", *common), cpu)
    step = trainer.train_step

    def step_then_signal():
        record = step()
        if trainer.step == 1:  # during the second step
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    trainer.train_step = step_then_signal
    assert trainer.train() == 143
    assert not (tmp_path / "b" / FINAL).exists()
    resumed = build_trainer(_config(checkpoint, data, tmp_path / "b", *common, "--resume"), cpu)
    assert resumed.train() == 0
    uninterrupted, interrupted = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [s for s, _ in interrupted] == [1, 2, 3, 4]
    assert interrupted == uninterrupted  # exactly, not approximately
    a = load_drafter(tmp_path / "a" / FINAL, ModelConfig.from_dir(checkpoint))
    b = load_drafter(tmp_path / "b" / FINAL, ModelConfig.from_dir(checkpoint))
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_two_gloo_processes_match_one_process_over_the_union_batch(setup, tmp_path, one_thread):
    checkpoint, data = setup
    env = {**os.environ, "PYTHONPATH": str(Path(peagle.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    common = ("--steps", "2", "--save-every", "100")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "peagle",
           *_args(checkpoint, data, tmp_path / "ddp", *common, "--batch-size", "1")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(_args(checkpoint, data, tmp_path / "one", *common, "--batch-size", "1", "--grad-accum", "2")) == 0
    assert os.environ["CUDA_COREDUMP_FILE"] == str((tmp_path / "one" / "faults").resolve() / "gpu-core.%p")
    # One process with half the batch must differ: the comparison is sensitive to what each process adds.
    assert main(_args(checkpoint, data, tmp_path / "half", *common, "--batch-size", "1")) == 0
    cfg = ModelConfig.from_dir(checkpoint)
    ddp, one, half = (load_drafter(tmp_path / name / FINAL, cfg) for name in ("ddp", "one", "half"))
    for (name, p), q in zip(ddp.state_dict().items(), one.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(ddp.fc.weight, half.fc.weight, rtol=1e-5, atol=1e-6)
    ddp_losses, one_losses = _losses(tmp_path / "ddp"), _losses(tmp_path / "one")
    assert [s for s, _ in ddp_losses] == [s for s, _ in one_losses] == [1, 2]
    assert [x for _, x in ddp_losses] == pytest.approx([x for _, x in one_losses], rel=1e-5)


def test_cli_trains_both_methods_and_writes_loadable_heads(setup, tmp_path):
    checkpoint, data = setup
    for method in ("peagle", "eagle3"):
        out = tmp_path / method
        args = _args(checkpoint, data, out, "--steps", "3", "--eval-every", "2", "--eval-fraction", "0.2")
        args[args.index("peagle")] = method
        assert main(args + ["--draft-vocab-size", "64"]) == 0
        head = load_drafter(out / FINAL, ModelConfig.from_dir(checkpoint))
        assert head.config.method == method and head.config.draft_vocab_size == 64
        assert head.config.aux_layer_ids == (1, 3, 4)
        records = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        evals = [r for r in records if r["kind"] == "eval"]
        assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [2, 3]
        assert all(len(r["acc"]) == 3 and r["positions_per_s"] > 0 and r["lr"] > 0 for r in train)
        assert all(r["tokens_per_s"] > 0 and "mfu" in r and r["mfu"] is None for r in train)  # no peak on a CPU
        assert set(evals[-1]["sim_al"]) == {"1", "2", "3"} and evals[-1]["rollouts"] > 0
        al = [evals[-1]["sim_al"][k] for k in ("1", "2", "3")]
        assert 1.0 <= al[0] <= al[1] <= al[2] <= 4.0
        walked = [evals[-1]["walk_al"][k] for k in ("1", "2", "3")]
        assert evals[-1]["rounds"] > 0 and 1.0 <= walked[0] <= 2.0 and all(1.0 <= w <= 4.0 for w in walked)


def test_clear_errors(setup, tmp_path, capsys):
    checkpoint, data = setup
    bad_data = tmp_path / "bad"
    write_dataset(bad_data, checkpoint)
    manifest = json.loads((bad_data / "manifest.json").read_text())
    manifest["tokenizer_fingerprint"] = "0123456789abcdef"
    (bad_data / "manifest.json").write_text(json.dumps(manifest))
    assert main(_args(checkpoint, bad_data, tmp_path / "x", "--steps", "1")) == 1
    assert "another tokenizer" in capsys.readouterr().err
    assert main(_args(checkpoint, data, tmp_path / "y", "--steps", "1", "--max-length", "100000")) == 1
    assert "longer than the target supports" in capsys.readouterr().err
    assert main(_args(checkpoint, data, tmp_path / "z", "--steps", "1", "--k-train", "0")) == 1
    assert "--k-train must be at least 1" in capsys.readouterr().err
    assert main(_args(checkpoint, data, tmp_path / "w", "--steps", "1", "--resume")) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


def test_schedule_and_simulated_acceptance_length():
    assert [lr_factor(s, 2, 6, "linear") for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert lr_factor(2, 2, 6, "cosine") == pytest.approx(1.0) and lr_factor(4, 2, 6, "cosine") == pytest.approx(0.5)
    # 10 rollouts at K=3: 4 miss draft 1, 3 match only draft 1, 2 match two, 1 matches all three.
    stats = EvalStats(StepStats.zero(3), torch.tensor([4, 3, 2, 1]))
    assert stats.acceptance_length(3) == pytest.approx(1 + (3 * 1 + 2 * 2 + 1 * 3) / 10)
    assert stats.acceptance_length(1) == pytest.approx(1 + 6 / 10)
    assert stats.conditional_accuracy() == pytest.approx([6 / 10, 3 / 6, 1 / 3])


def test_feature_cache_reuses_the_target_outputs(setup, tmp_path):
    checkpoint, data = setup
    cpu = DistContext(0, 1, torch.device("cpu"))
    common = ("--steps", "3", "--batch-size", "2", "--save-every", "100")
    plain = build_trainer(_config(checkpoint, data, tmp_path / "plain", *common), cpu)
    assert plain.train() == 0
    cache = tmp_path / "cache"
    cached = build_trainer(_config(checkpoint, data, tmp_path / "cached", *common, "--feature-cache", str(cache)), cpu)
    assert cached.train() == 0
    files = sorted(cache.glob("doc-*.safetensors"))
    assert len(files) >= 6  # every document of the 6 sequences trained
    for (step_a, loss_a), (step_b, loss_b) in zip(_losses(tmp_path / "plain"), _losses(tmp_path / "cached")):
        assert step_a == step_b and loss_a == pytest.approx(loss_b, rel=1e-5)
    # Reading back: the cached pass equals the target's pass over the packed sequence.
    seq = cached.data.epoch(0)[0]
    direct = run_target(cached.target, seq, cached.aux_layer_ids, "cpu")
    again = cached.cache.run(seq, cached.aux_layer_ids, "cpu")
    torch.testing.assert_close(again.features, direct.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again.hidden, direct.hidden, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="another target"):
        build_trainer(_config(checkpoint, data, tmp_path / "other", *common, "--feature-cache", str(cache),
                              "--max-length", "48"), cpu)


def test_time_limit_finishes_with_a_final_head(setup, tmp_path):
    checkpoint, data = setup
    out = tmp_path / "timed"
    assert main(_args(checkpoint, data, out, "--steps", "500", "--time-limit", "0.0001")) == 0
    assert load_drafter(out / FINAL, ModelConfig.from_dir(checkpoint)).config.method == "peagle"
    steps = [step for step, _ in _losses(out)]
    assert steps == [1]  # the deadline had passed after the first step; the run still ended cleanly


def test_default_warmup_is_short_under_a_time_limit(setup, tmp_path):
    checkpoint, data = setup
    plain = TrainConfig(target=checkpoint, data=data, out=tmp_path, method="peagle", steps=100_000)
    timed = TrainConfig(target=checkpoint, data=data, out=tmp_path, method="peagle", steps=100_000,
                        time_limit_minutes=5)
    assert plain.warmup(100_000) == 2000 and timed.warmup(100_000) == 30 and timed.warmup(500) == 10
    assert TrainConfig(target=checkpoint, data=data, out=tmp_path, method="peagle", steps=10, warmup_steps=7,
                       time_limit_minutes=5).warmup(100_000) == 7


def test_padded_target_pass_trains_the_same_steps(setup, tmp_path):
    """--pad-target-pass changes the target pass's shapes, not what is trained: the same losses step by step."""
    checkpoint, data = setup
    losses = []
    for name, extra in (("plain", ()), ("padded", ("--pad-target-pass",))):
        assert main(_args(checkpoint, data, tmp_path / name, "--steps", "3", "--log-every", "1", *extra)) == 0
        losses.append([loss for _, loss in _losses(tmp_path / name)])
    assert len(losses[0]) == 3
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    with pytest.raises(ValueError, match="--pad-target-pass .* --feature-cache"):
        TrainConfig(target=checkpoint, data=data, out=tmp_path / "x", method="peagle", steps=1, pad_target_pass=True,
                    feature_cache=tmp_path / "cache")


def test_steps_planned_inline_train_the_same_steps_without_a_planning_thread(setup, tmp_path, one_thread,
                                                                            monkeypatch):
    """--prefetch-steps 0 plans each step in the training loop: no second thread, the same losses step by step;
    a negative count is refused."""
    import threading

    checkpoint, data = setup
    threads = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (threads.append(self.name), start(self))[1])
    losses = []
    for name, extra in (("ahead", ()), ("inline", ("--prefetch-steps", "0"))):
        threads.clear()
        assert main(_args(checkpoint, data, tmp_path / name, "--steps", "3", "--log-every", "1", *extra)) == 0
        losses.append([loss for _, loss in _losses(tmp_path / name)])
        assert ("plan-prefetch" in threads) == (name == "ahead")
    assert len(losses[0]) == 3
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    with pytest.raises(ValueError, match="--prefetch-steps must be non-negative"):
        _config(checkpoint, data, tmp_path / "x", "--steps", "1", "--prefetch-steps", "-1")


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_shape_multiple_trains_the_same_steps(setup, tmp_path, method):
    """--shape-multiple pads the step's matrices (target pass, teacher table, drafter rows, charged elements) with
    rows that carry nothing: the same losses step by step; a multiple the attention's tiles cannot take is refused."""
    checkpoint, data = setup
    losses = []
    for name, extra in (("plain", ()), ("padded", ("--shape-multiple", "256"))):
        args = _args(checkpoint, data, tmp_path / f"{method}-{name}", "--steps", "3", "--log-every", "1", *extra)
        args[args.index("--method") + 1] = method
        assert main(args) == 0
        losses.append([loss for _, loss in _losses(tmp_path / f"{method}-{name}")])
    assert len(losses[0]) == 3
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    with pytest.raises(ValueError, match="--shape-multiple must be a multiple of 128"):
        TrainConfig(target=checkpoint, data=data, out=tmp_path / "x", method="peagle", steps=1, shape_multiple=100)


def test_default_learning_rate_per_method(setup, tmp_path):
    checkpoint, data = setup
    cfg = lambda **kw: TrainConfig(target=checkpoint, data=data, out=tmp_path, steps=10, **kw)  # noqa: E731
    assert cfg(method="peagle").lr == 1e-3 and cfg(method="eagle3").lr == 6e-4
    assert cfg(method="peagle", lr=2e-4).lr == 2e-4 and cfg(method="eagle3", lr=1e-3).lr == 1e-3
    with pytest.raises(ValueError, match="--lr must be positive"):
        cfg(method="peagle", lr=0.0)
    args = build_parser().parse_args(["train", "--target", str(checkpoint), "--data", str(data), "--out",
                                      str(tmp_path), "--method", "eagle3", "--max-length", "64", "--steps", "1"])
    assert args.lr is None and train_config(args).lr == 6e-4  # the config picks the method's default


def test_default_training_depth_per_method(setup, tmp_path):
    # Each method trains as deep as it serves best: P-EAGLE 8 (K=7-11), EAGLE-3 3 (its best K; run 19).
    checkpoint, data = setup
    cfg = lambda **kw: TrainConfig(target=checkpoint, data=data, out=tmp_path, steps=10, **kw)  # noqa: E731
    assert cfg(method="peagle").k_train == 8 and cfg(method="eagle3").k_train == 3
    assert cfg(method="eagle3", k_train=7).k_train == 7 and cfg(method="peagle", k_train=12).k_train == 12
    with pytest.raises(ValueError, match="--k-train must be at least 1"):
        cfg(method="eagle3", k_train=0)
    for method, depth in (("eagle3", 3), ("peagle", 8)):
        args = build_parser().parse_args(["train", "--target", str(checkpoint), "--data", str(data), "--out",
                                          str(tmp_path), "--method", method, "--steps", "1"])
        assert args.k_train is None and train_config(args).k_train == depth


def test_time_limit_fits_the_schedule_to_the_time():
    # 100 s left at 0.5 s per step: 190 more steps fit (5% is kept for evaluation and saving).
    assert fitted_total_steps(30, 100_000, 0.5, 100.0) == 220
    assert fitted_total_steps(30, 100, 0.5, 100.0) == 100  # never more than asked for
    assert fitted_total_steps(30, 100_000, 5.0, 1.0) == 31  # at least one more step


def test_time_limited_run_ends_its_schedule_when_time_runs_out(setup, tmp_path, monkeypatch):
    # A fake clock (0.05 s per step) so that the test does not depend on how fast this machine runs the steps.
    import peagle.training.trainer as trainer_module

    checkpoint, data = setup
    clock = [0.0]
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: clock[0])
    step = trainer_module.Trainer.train_step

    def timed_step(self):
        clock[0] += 0.05
        return step(self)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", timed_step)
    out = tmp_path / "fitted"
    args = _args(checkpoint, data, out, "--steps", "100000", "--time-limit", "0.15")
    at = args.index("--warmup-steps")
    assert main(args[:at] + args[at + 2:]) == 0  # the default warmup
    records = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    fitted = [r for r in records if r["kind"] == "schedule"]
    # Fitted after step 30, then again to the rate of every 50 steps (recorded where the horizon moved).
    assert fitted[0]["step"] == 30 and all(r["requested_steps"] == 100_000 for r in fitted)
    assert all(r["step"] > 30 and (r["step"] - 30) % 50 == 0 for r in fitted[1:])
    horizon = fitted[-1]["total_steps"]
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["step"] < r["total_steps"] < 100_000 for r in fitted) and train[-1]["step"] <= horizon
    peak = max(r["lr"] for r in train)
    # The warmup is not 2% of --steps (2,000 steps, longer than the run) but 30 steps: the peak is reached.
    assert peak == pytest.approx(3e-3) and train[29]["lr"] == pytest.approx(3e-3)
    if train[-1]["step"] == horizon:  # ended by the fitted horizon (not the deadline): the lr has decayed
        assert train[-1]["lr"] < 0.1 * peak


def test_time_limited_horizon_follows_a_change_of_rate(setup, tmp_path, monkeypatch):
    # A fake clock: 1 s per step until step 40, then 0.25 s (the GPU freed by a run sharing it). The horizon fitted
    # at step 30 (87 steps in the 90 s) must grow at the refits, and the run must use the time it has.
    import peagle.training.trainer as trainer_module

    checkpoint, data = setup
    clock = [0.0]
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: clock[0])
    step = trainer_module.Trainer.train_step

    def timed_step(self):
        clock[0] += 1.0 if self.step < 40 else 0.25
        return step(self)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", timed_step)
    out = tmp_path / "refit"
    assert main(_args(checkpoint, data, out, "--steps", "100000", "--time-limit", "1.5", "--save-every", "100000",
                      "--max-length", "32")) == 0
    records = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    horizons = [(r["step"], r["total_steps"]) for r in records if r["kind"] == "schedule"]
    assert horizons[0] == (30, 87)
    assert horizons[1][0] == 80 and horizons[1][1] > 150  # the faster rate counts from the next window on
    last = [r for r in records if r["kind"] == "train"][-1]
    assert last["step"] == horizons[-1][1] and 230 <= last["step"] <= 245 and clock[0] <= 90.0
    assert last["lr"] < 0.01 * 3e-3  # the cosine reached its end with the time, not at the first horizon


def test_profile_steps_write_an_operator_table(setup, tmp_path, monkeypatch):
    from peagle.training import trainer

    monkeypatch.delenv(trainer.CUPTI_TEARDOWN_ENV, raising=False)
    checkpoint, data = setup
    out = tmp_path / "profiled"
    assert main(_args(checkpoint, data, out, "--steps", "8", "--profile-steps", "2")) == 0
    text = (out / "profile.txt").read_text()
    assert text.startswith("torch.profiler over steps 6..7 of a peagle run") and "aten::" in text
    assert os.environ[trainer.CUPTI_TEARDOWN_ENV] == "1"  # the tracer leaves with the profile, not after the run
    monkeypatch.setenv(trainer.CUPTI_TEARDOWN_ENV, "0")  # the user's own choice is kept
    assert main(_args(checkpoint, data, tmp_path / "again", "--steps", "7", "--profile-steps", "1")) == 0
    assert os.environ[trainer.CUPTI_TEARDOWN_ENV] == "0"
    assert main(_args(checkpoint, data, tmp_path / "bad", "--steps", "1", "--profile-steps", "-1")) == 1


def test_several_data_directories_are_mixed(setup, tmp_path):
    checkpoint, data = setup
    other = write_dataset(tmp_path / "other", checkpoint, num_docs=10, seed=1)
    cpu = DistContext(0, 1, torch.device("cpu"))
    cfg = _config(checkpoint, data, tmp_path / "out", "--steps", "1")
    both = train_config(build_parser().parse_args([*_args(checkpoint, data, tmp_path / "out2", "--steps", "1"),
                                                   "--data", str(data), str(other)]))
    assert cfg.data == (data,) and both.data == (data, other)
    one, two = build_trainer(cfg, cpu), build_trainer(both, cpu)
    assert len(two.data.documents) == len(one.data.documents) + 10
    assert json.loads((tmp_path / "out2" / "train_config.json").read_text())["data"] == [str(data), str(other)]


def test_feature_noise_changes_training_not_evaluation_and_repeats_with_its_seed(setup, tmp_path, one_thread):
    checkpoint, data = setup
    cpu = DistContext(0, 1, torch.device("cpu"))
    common = ("--steps", "3", "--save-every", "100")
    runs = {}
    for name, extra in (("plain", ("--feature-noise", "0")), ("noisy", ("--feature-noise", "0.5")),
                        ("again", ("--feature-noise", "0.5"))):
        trainer = build_trainer(_config(checkpoint, data, tmp_path / name, *common, *extra), cpu)
        plan = trainer.prepare(0, 0).plans[0]
        clean = trainer._teacher(plan.sequence)
        assert len(plan.noise_seeds) == 1 and plan.noise_seeds[0][1] == len(plan.sequence)
        if name == "plain":
            assert trainer._noisy(clean, plan.noise_seeds) is clean
        else:
            noisy = trainer._noisy(clean, plan.noise_seeds)
            delta = (noisy.features - clean.features).float()
            assert delta.std().item() == pytest.approx(0.5, rel=0.1)  # the asked-for std, on features only
            assert torch.equal(noisy.hidden, clean.hidden)  # the teacher distribution is untouched
            other = trainer.prepare(0, 1).plans[0].noise_seeds
            assert other != plan.noise_seeds  # each sequence draws its own noise
        assert trainer.train() == 0
        runs[name] = _losses(tmp_path / name)
    assert runs["noisy"] == runs["again"]  # the same seed draws the same noise
    assert runs["noisy"][0][1] != runs["plain"][0][1]
    assert main(_args(checkpoint, data, tmp_path / "bad", "--steps", "1", "--feature-noise", "-1")) == 1


def test_evaluation_walks_each_data_source_apart(setup, tmp_path):
    checkpoint, data = setup
    other = write_dataset(tmp_path / "other", checkpoint, num_docs=12, seed=2)
    cpu = DistContext(0, 1, torch.device("cpu"))
    cfg = train_config(build_parser().parse_args([*_args(checkpoint, data, tmp_path / "out", "--steps", "1"),
                                                  "--data", str(data), str(other), "--eval-fraction", "0.25"]))
    trainer = build_trainer(cfg, cpu)
    assert sorted(set(trainer.held_source)) == [0, 1]  # both sources are held out from
    row = trainer.evaluate()
    by_source = row["walk_al_by_source"]
    assert set(by_source) == {data.name, other.name}
    for walks in by_source.values():
        assert set(walks) == set(row["walk_al"]) and all(v >= 1.0 for v in walks.values())
    # The pooled walk lies between the sources' walks at every K.
    for j in row["walk_al"]:
        values = [w[j] for w in by_source.values()]
        assert min(values) - 1e-9 <= row["walk_al"][j] <= max(values) + 1e-9


def test_scalars_flatten_nested_eval_rows_for_tensorboard():
    # An eval row holds dicts of dicts (walk_al_by_source); tensorboard's add_scalar takes numbers only.
    from peagle.training.trainer import _scalars

    row = {"kind": "eval", "step": 500, "loss": 2.5, "acc": [0.8, None, 0.4], "walk_al": {"7": 3.1},
           "walk_al_by_source": {"data-code": {"3": 2.0, "7": 2.9}}, "resumed": True, "note": "text"}
    assert dict(_scalars(row)) == {"loss": 2.5, "acc/1": 0.8, "acc/3": 0.4, "walk_al/7": 3.1,
                                   "walk_al_by_source/data-code/3": 2.0, "walk_al_by_source/data-code/7": 2.9}


def test_answer_tokens_count_like_document_by_document():
    from peagle.drafters.vocab import count_tokens
    from peagle.training.data import Document
    from peagle.training.trainer import _answer_tokens

    g = torch.Generator().manual_seed(0)
    docs = [Document(torch.randint(0, 50, (n,), generator=g), torch.rand(n, generator=g) > 0.4) for n in (1, 7, 30)]
    docs.append(Document(torch.tensor([3, 4]), torch.tensor([False, False])))
    per_doc = count_tokens([d.token_ids[d.loss_mask].tolist() for d in docs], 50)
    assert torch.equal(count_tokens([_answer_tokens(docs)], 50), per_doc)
    assert int(per_doc.sum()) == sum(int(d.loss_mask.sum()) for d in docs)


def test_eval_data_is_scored_apart_and_never_trained_on(setup, tmp_path):
    checkpoint, data = setup
    other = write_dataset(tmp_path / "other", checkpoint, num_docs=10, seed=5)
    cpu = DistContext(0, 1, torch.device("cpu"))
    trained = build_trainer(_config(checkpoint, data, tmp_path / "plain", "--steps", "1"), cpu)

    # --eval-fraction 0: nothing held out of --data, so the eval row is --eval-data's alone.
    cfg = _config(checkpoint, data, tmp_path / "out", "--steps", "1", "--eval-every", "1", "--eval-data", str(other))
    trainer = build_trainer(cfg, cpu)
    assert len(trainer.data.documents) == len(trained.data.documents)  # none of other's documents is trained on
    assert not trainer.held_out and sum(len(s.doc_lengths) for s in trainer.eval_data) == 10
    row = trainer.evaluate()
    assert set(row) == {"eval_data"}
    scores = row["eval_data"]
    assert set(scores["walk_al"]) == {"1", "2", "3"} and all(v >= 1.0 for v in scores["walk_al"].values())
    assert set(scores["walk_al_by_source"]) == {other.name}
    assert trainer.train() == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / LOG_FILE).read_text().splitlines()]
    assert [r["eval_data"]["walk_al"] for r in rows if r["kind"] == "eval"] != []

    # Beside a held-out share of --data, each keeps its own scores; --max-eval-documents caps each directory.
    both = build_trainer(_config(checkpoint, data, tmp_path / "both", "--steps", "1", "--eval-fraction", "0.25",
                                 "--eval-data", str(other), "--max-eval-data-documents", "4"), cpu).evaluate()
    assert {"walk_al", "acc", "eval_data"} <= set(both)
    assert both["eval_data"]["rounds"] < scores["rounds"]  # 4 of the 10 documents


def test_eval_data_scores_without_the_few_training_documents_it_holds(setup, tmp_path, caplog):
    # A short prompt ("hi") can be in both an evaluation set and the training data, answered alike: such documents
    # are left out of the scores, and --max-eval-data-documents counts the rest.
    from peagle.training.data import read_documents

    checkpoint, data = setup
    tokenizer, vocab = load_tokenizer(checkpoint), ModelConfig.from_dir(checkpoint).vocab_size
    fresh = read_documents(write_dataset(tmp_path / "fresh", checkpoint, num_docs=10, seed=5), tokenizer, vocab)
    trained = read_documents(data, tokenizer, vocab)
    mixed = tmp_path / "mixed"
    docs = [trained[3], *fresh[:5], trained[7], *fresh[5:]]
    mixed.mkdir()
    write_shard(mixed / "shard-00000.safetensors", docs)
    Manifest(tokenizer_fingerprint(tokenizer), vocab, "tiny", {},
             [{"file": "shard-00000.safetensors", "first_prompt": 0, "num_prompts": len(docs),
               "num_documents": len(docs), "num_tokens": sum(len(d) for d in docs)}]).write(mixed)
    cpu = DistContext(0, 1, torch.device("cpu"))
    with caplog.at_level("WARNING"):
        trainer = build_trainer(_config(checkpoint, data, tmp_path / "out", "--steps", "1", "--eval-data",
                                        str(mixed), "--max-eval-data-documents", "8"), cpu)
    assert "2 of its 12 documents are training documents too" in caplog.text
    lengths = [n for s in trainer.eval_data for n in s.doc_lengths]
    assert lengths == [len(d) for d in fresh[:8]]


def test_eval_data_refusals(setup, tmp_path):
    checkpoint, data = setup
    cpu = DistContext(0, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="both --data and --eval-data"):
        _config(checkpoint, data, tmp_path / "a", "--steps", "1", "--eval-data", str(data))
    with pytest.raises(ValueError, match="both --data and --eval-data"):  # one directory, not its characters
        TrainConfig(target=checkpoint, data=data, out=tmp_path / "a", method="peagle", steps=1, eval_data=str(data))
    with pytest.raises(ValueError, match="--max-eval-data-documents"):
        _config(checkpoint, data, tmp_path / "a", "--steps", "1", "--max-eval-data-documents", "0")
    copy = tmp_path / "copy"  # the training documents under another name
    copy.mkdir()
    for f in data.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="24 of the 24 documents .* are training documents too"):
        build_trainer(_config(checkpoint, data, tmp_path / "b", "--steps", "1", "--eval-data", str(copy)), cpu)
    # An evaluation set (`peagle regenerate --eval-set`) is never training data.
    manifest = Manifest.read(copy)
    manifest.source = {**manifest.source, "evaluation_only": True}
    manifest.write(copy)
    with pytest.raises(ValueError, match="is an evaluation set"):
        build_trainer(_config(checkpoint, copy, tmp_path / "c", "--steps", "1"), cpu)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(setup, tmp_path):
    checkpoint, data = setup
    trainer = build_trainer(_config(checkpoint, data, tmp_path / "m", "--steps", "2", "--optimizer", "muon",
                                    "--no-freeze-lm-head"), DistContext(0, 1, torch.device("cpu")))
    muon, adamw = muon_split(trainer.drafter)
    muon_names, adamw_names = {n for n, _ in muon}, {n for n, _ in adamw}
    assert muon_names == {"fc.weight", *(f"layers.0.{m}.weight" for m in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))}
    assert {"embed_tokens.weight", "lm_head.weight", "mask_hidden", "norm.weight"} <= adamw_names
    assert not muon_names & adamw_names
    assert len(muon) + len(adamw) == len(trainer.params)  # every trained parameter, once
    muon_opt, adamw_opt = trainer.optimizer.optimizers
    assert isinstance(muon_opt, Muon) and isinstance(adamw_opt, torch.optim.AdamW)
    (group,) = muon_opt.param_groups
    blocks = dict(zip((id(p) for p in group["params"]), group["blocks"]))
    attn, mlp = trainer.drafter.layers[0].self_attn, trainer.drafter.layers[0].mlp
    assert blocks[id(attn.qkv_proj.weight)] == [attn.q_size, attn.kv_size, attn.kv_size]
    assert blocks[id(mlp.gate_up_proj.weight)] == [mlp.intermediate] * 2 and blocks[id(mlp.down_proj.weight)] is None


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_muon_of_one_block_is_torch_muon_and_blocks_step_as_separate_matrices(shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    a = Muon([ours], [None], lr=0.02, weight_decay=0.1)
    b = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        ours.grad = torch.randn(shape, generator=gen)
        theirs.grad = ours.grad.clone()
        a.step(), b.step()
    assert torch.equal(ours, theirs)
    # A fused [q; k; v] matrix steps as its three blocks would, each alone, and not as one matrix.
    rows = [16, 4, 4]
    fused = torch.nn.Parameter(torch.randn(sum(rows), 40, generator=gen))
    parts = [torch.nn.Parameter(x.clone()) for x in fused.detach().split(rows)]
    whole = torch.nn.Parameter(fused.detach().clone())
    grad = torch.randn(fused.shape, generator=gen)
    fused.grad, whole.grad = grad.clone(), grad.clone()
    for p, g in zip(parts, grad.split(rows)):
        p.grad = g.clone()
    Muon([fused], [rows], lr=0.02).step()
    Muon(parts, [None] * 3, lr=0.02).step()
    Muon([whole], [None], lr=0.02).step()
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in parts]))
    assert not torch.allclose(fused, whole)


def test_muon_orthogonalises_blocks_of_one_shape_together():
    """Blocks of one shape, tall ones transposed, go through one batched Newton-Schulz: what each alone gives, to
    bf16's precision; the step of many such matrices is the step of each alone."""
    from peagle.training.optimizers import orthogonalise, orthogonalise_batch

    gen = torch.Generator().manual_seed(3)
    g = torch.randn(5, 12, 30, generator=gen)
    torch.testing.assert_close(orthogonalise_batch(g).float(), torch.stack([orthogonalise(x) for x in g]).float(),
                               atol=2e-2, rtol=2e-2)
    shapes = [(12, 30), (30, 12), (12, 30), (8, 30), (12, 30)]  # (12, 30) x 3 and its transpose: one batch of 4
    ws = [torch.randn(s, generator=gen) for s in shapes]
    together = [torch.nn.Parameter(w.clone()) for w in ws]
    alone = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = Muon(together, [None] * len(ws), lr=0.02, weight_decay=0.1)
    opts = [Muon([p], [None], lr=0.02, weight_decay=0.1) for p in alone]
    for _ in range(3):
        for a, b in zip(together, alone):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        for o in opts:
            o.step()
    for a, b, w in zip(together, alone, ws):
        torch.testing.assert_close(a.detach(), b.detach(), atol=2e-3, rtol=0)
        assert (a - w).abs().max() > 0.01  # it moved, more than the tolerance


def test_muon_trains_resumes_exactly_and_refuses_another_optimizer(setup, tmp_path, one_thread):
    checkpoint, data = setup
    cpu = DistContext(0, 1, torch.device("cpu"))
    common = ("--steps", "4", "--save-every", "2", "--optimizer", "muon", "--muon-lr", "2e-2")
    assert build_trainer(_config(checkpoint, data, tmp_path / "a", *common), cpu).train() == 0
    losses = _losses(tmp_path / "a")
    assert [s for s, _ in losses] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(x)) for _, x in losses)
    rows = [json.loads(line) for line in (tmp_path / "a" / LOG_FILE).read_text().splitlines()]
    assert all(r["lr"] <= 3e-3 for r in rows if r["kind"] == "train")  # the log's lr is AdamW's (--lr 3e-3)
    # Stopped by SIGTERM in its third step, resumed: the same losses and weights as the uninterrupted run (both
    # optimizers' states and schedules come back).
    b = tmp_path / "b"
    trainer = build_trainer(_config(checkpoint, data, b, *common), cpu)
    step = trainer.train_step

    def step_then_signal():
        record = step()
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    trainer.train_step = step_then_signal
    assert trainer.train() == 143
    assert build_trainer(_config(checkpoint, data, b, *common, "--resume"), cpu).train() == 0
    assert _losses(b) == losses
    cfg = ModelConfig.from_dir(checkpoint)
    for (name, p), q in zip(load_drafter(tmp_path / "a" / FINAL, cfg).state_dict().items(),
                            load_drafter(b / FINAL, cfg).state_dict().values()):
        assert torch.equal(p, q), name
    # A different --muon-lr gives another run (the option is used), AdamW yet another.
    assert build_trainer(_config(checkpoint, data, tmp_path / "c", "--steps", "4", "--save-every", "2",
                                 "--optimizer", "muon", "--muon-lr", "5e-3"), cpu).train() == 0
    assert _losses(tmp_path / "c")[1:] != losses[1:]
    with pytest.raises(ValueError, match="trained with --optimizer muon, this run has --optimizer adamw"):
        build_trainer(_config(checkpoint, data, b, "--steps", "6", "--resume", "--optimizer", "adamw"), cpu).train()


def test_optimizer_option_refusals(setup, tmp_path):
    checkpoint, data = setup
    with pytest.raises(ValueError, match="--muon-lr .* with --optimizer muon only"):
        _config(checkpoint, data, tmp_path / "x", "--steps", "1", "--optimizer", "adamw", "--muon-lr", "1e-2")
    with pytest.raises(SystemExit):
        _config(checkpoint, data, tmp_path / "x", "--steps", "1", "--optimizer", "sgd")


def test_optimizer_default_depends_on_the_method(setup, tmp_path):
    """Muon for P-EAGLE (run 14) and EAGLE-3 (run 15) unless --optimizer says otherwise; --muon-lr goes with Muon."""
    checkpoint, data = setup
    assert _config(checkpoint, data, tmp_path / "x", "--steps", "1").optimizer == "muon"
    assert _config(checkpoint, data, tmp_path / "x", "--steps", "1", "--muon-lr", "1e-2").muon_lr == 1e-2
    assert _config(checkpoint, data, tmp_path / "x", "--steps", "1", "--optimizer", "adamw").optimizer == "adamw"
    eagle3 = _args(checkpoint, data, tmp_path / "x", "--steps", "1")
    eagle3[eagle3.index("--method") + 1] = "eagle3"
    assert train_config(build_parser().parse_args(eagle3)).optimizer == "muon"
    assert train_config(build_parser().parse_args(eagle3 + ["--optimizer", "adamw"])).optimizer == "adamw"
    assert TrainConfig(target=str(checkpoint), data=(str(data),), out=str(tmp_path / "y"), method="eagle3",
                       steps=1).optimizer == "muon"


def test_checkpoints_from_before_the_optimizer_option_resume(setup, tmp_path):
    from peagle.training.trainer import CHECKPOINTS, TRAINER_STATE, complete_checkpoints

    checkpoint, data = setup
    cpu = DistContext(0, 1, torch.device("cpu"))
    common = ("--steps", "2", "--save-every", "2", "--optimizer", "adamw")
    assert build_trainer(_config(checkpoint, data, tmp_path / "a", *common), cpu).train() == 0
    path = complete_checkpoints(tmp_path / "a" / CHECKPOINTS)[-1] / TRAINER_STATE
    state = torch.load(path, weights_only=False)
    (adamw,), (schedule,) = state["optimizers"]["optimizers"], state["optimizers"]["schedulers"]
    legacy = {k: v for k, v in state.items() if k != "optimizers"} | {"optimizer": adamw, "scheduler": schedule}
    torch.save(legacy, path)
    trainer = build_trainer(_config(checkpoint, data, tmp_path / "a", "--steps", "3", "--resume", "--optimizer",
                                    "adamw"), cpu)
    trainer._load_latest()
    assert trainer.step == 2 and trainer.optimizer.schedulers[0].last_epoch == schedule["last_epoch"]
    loaded = trainer.optimizer.optimizers[0].state_dict()["state"]
    assert all(torch.equal(loaded[i]["exp_avg"], adamw["state"][i]["exp_avg"]) for i in adamw["state"])


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_freeze_embeddings_keeps_the_targets_rows_and_trains_only_the_mask_row(setup, tmp_path, method):
    from peagle.drafters.target import TargetParts

    checkpoint, data = setup
    target_rows = TargetParts.from_dir(checkpoint).embedding.float()
    heads = {}
    for name, extra in (("frozen", ["--freeze-embeddings"]), ("trained", [])):
        assert main([*_args(checkpoint, data, tmp_path / name, "--steps", "3", *extra), "--method", method]) == 0
        heads[name] = load_drafter(tmp_path / name / FINAL, ModelConfig.from_dir(checkpoint), dtype="float32")
    frozen, trained = (heads[n].embed_tokens.weight.detach() for n in ("frozen", "trained"))
    moved = (frozen != target_rows.to(frozen.dtype)).any(dim=1).nonzero().flatten().tolist()
    mask_row = heads["frozen"].config.mask_token_id
    assert moved == ([mask_row] if method == "peagle" else [])  # P-EAGLE's learned mask-token embedding alone
    assert (trained != target_rows.to(trained.dtype)).any(dim=1).sum() > 1  # without the option the rows learn


def test_freeze_embeddings_refuses_weight_decay(setup, tmp_path, capsys):
    checkpoint, data = setup
    assert main(_args(checkpoint, data, tmp_path / "wd", "--steps", "1", "--freeze-embeddings",
                      "--weight-decay", "0.01")) == 1
    assert "--freeze-embeddings with --weight-decay 0.01" in capsys.readouterr().err


def test_a_device_fault_records_the_unfinished_steps_and_replay_runs_them_alone(setup, tmp_path, one_thread,
                                                                                monkeypatch, capsys):
    from peagle.training import objectives
    from peagle.training.trainer import FAULT_PLANS, FAULT_RECORD, FAULTS

    checkpoint, data = setup
    common = ("--steps", "6", "--save-every", "2", "--log-every", "2", "--batch-size", "2")
    cpu = DistContext(0, 1, torch.device("cpu"))
    assert build_trainer(_config(checkpoint, data, tmp_path / "clean", *common), cpu).train() == 0
    clean = dict(_losses(tmp_path / "clean"))

    backward, calls = objectives.Objective.backward, {"n": 0, "fault_at": 4}

    def faulting(self, *args, **kwargs):  # the 4th micro-batch pass is step 4's: steps 1-2 were read back at 2
        calls["n"] += 1
        if calls["n"] == calls["fault_at"]:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(objectives.Objective, "backward", faulting)
    core = tmp_path / "run" / FAULTS / f"gpu-core.{os.getpid()}"  # as CUDA writes it when `peagle train` armed it
    core.parent.mkdir(parents=True)
    core.write_bytes(b"ELF")
    trainer = build_trainer(_config(checkpoint, data, tmp_path / "run", *common), cpu)
    positions = []
    prepare = trainer.prepare
    trainer.prepare = lambda epoch, index, pin=True: positions.append((epoch, index)) or prepare(epoch, index, pin)
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        trainer.train()
    fault = tmp_path / "run" / FAULTS / "step-00000003"
    record = json.loads((fault / FAULT_RECORD).read_text())
    assert "unspecified launch failure" in record["error"]
    assert [s["step"] for s in record["steps"]] == [3, 4]  # step 3 was never read back: it may be the faulty one
    assert [(s["epoch"], s["index"]) for s in record["steps"]] == positions[2:4]
    assert record["steps"][0]["micro_batches"][0]["forwards"][0]["elements"] > 0
    assert record["replay"] == f"peagle train-replay {fault}"
    assert record["gpu_core"] == str(core) and f"target cudacore {core}" in record["read_core"]
    # The recorded plans are the ones the steps ran: planning again from the position gives the same tensors.
    plans = torch.load(fault / FAULT_PLANS, weights_only=False)["steps"]
    again = prepare(*positions[3], pin=False)
    assert torch.equal(plans[1]["prepared"].plans[0].layout.anchor, again.plans[0].layout.anchor)

    # Replay from the step-2 checkpoint: steps 3 and 4 alone, the same losses as the run that never faulted.
    monkeypatch.setattr(objectives.Objective, "backward", backward)
    assert main(["train-replay", str(fault)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])["steps"]
    assert [(r["step"], r["error"]) for r in rows] == [(3, None), (4, None)]
    assert [r["loss"] for r in rows] == [clean[3], clean[4]]
    assert "step 4 (epoch 0, sequence" in out and "ran clean" in out

    # With the run's first two steps before them (kernels meet the shapes in the run's order), the recorded steps
    # start from the same restored state: the same losses; the history's rows are its steps from the start.
    assert main(["train-replay", str(fault), "--history", "2"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])["steps"]
    assert [(r["step"], r.get("history", False), r["error"]) for r in rows] == [
        (1, True, None), (2, True, None), (3, False, None), (4, False, None)]
    assert [(r["epoch"], r["index"]) for r in rows[:2]] == positions[:2]
    assert [r["loss"] for r in rows[2:]] == [clean[3], clean[4]]  # the history's updates were undone
    assert "history step 2 (epoch 0, sequence" in out

    # A step that faults again is named, and the ones after it are not run.
    calls.update(n=0, fault_at=1)
    monkeypatch.setattr(objectives.Objective, "backward", faulting)
    assert main(["train-replay", str(fault)]) == 1
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"]
    assert len(rows) == 1 and "unspecified launch failure" in rows[0]["error"]


def test_train_replay_refuses_a_directory_without_plans(tmp_path, capsys):
    assert main(["train-replay", str(tmp_path)]) != 0
    assert f"{tmp_path} holds no plans.pt" in capsys.readouterr().err


def test_a_fault_outside_a_training_step_is_recorded_as_such(setup, tmp_path):
    from peagle.training.trainer import FAULT_RECORD, FAULTS

    checkpoint, data = setup
    cfg = _config(checkpoint, data, tmp_path / "run", "--steps", "4", "--eval-every", "2", "--log-every", "2")
    trainer = build_trainer(replace(cfg, eval_fraction=0.2), DistContext(0, 1, torch.device("cpu")))

    def evaluate():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    trainer.evaluate = evaluate
    with pytest.raises(RuntimeError, match="illegal memory access"):
        trainer.train()
    record = json.loads((tmp_path / "run" / FAULTS / "step-00000003" / FAULT_RECORD).read_text())
    assert [s["step"] for s in record["steps"]] == [3] and "evaluation or a checkpoint save" in record["note"]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_trains_against_mixture_of_experts_targets(tiny_hf_checkpoint, tmp_path, family):
    """The teacher runs through the experts, GPT-OSS's sinks and its sliding window (documents of 12-40 tokens
    against a window of 6); both methods train and write heads that load against the target."""
    checkpoint = tiny_hf_checkpoint(family, num_layers=4)
    data = write_dataset(tmp_path / "data", checkpoint)
    for method in ("peagle", "eagle3"):
        out = tmp_path / method
        args = _args(checkpoint, data, out, "--steps", "4", "--lr", "1e-2")
        args[args.index("peagle")] = method
        args[args.index("--aux-layer-ids") + 1:args.index("--aux-layer-ids") + 4] = ["1", "2", "3"]
        assert main(args) == 0
        losses = [loss for _, loss in _losses(out)]
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
        head = load_drafter(out / FINAL, ModelConfig.from_dir(checkpoint))
        assert head.config.method == method and head.config.aux_layer_ids == (1, 2, 3)


def test_dummy_load_format_trains_against_a_config_alone(tiny_hf_checkpoint, tmp_path, caplog, capsys):
    """--load-format dummy: a random target of config.json's shape (no weights on disk), for throughput at a real
    shape; without it the same directory is refused, and the feature cache, which would keep random features, too."""
    import shutil

    checkpoint = tiny_hf_checkpoint("qwen3_moe", num_layers=4)
    data = write_dataset(tmp_path / "data", checkpoint)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, config_only)
    args = _args(config_only, data, tmp_path / "run", "--steps", "3")
    args[args.index("--aux-layer-ids") + 1:args.index("--aux-layer-ids") + 4] = ["1", "2", "3"]
    assert main([*args, "--load-format", "dummy"]) == 0
    losses = [loss for _, loss in _losses(tmp_path / "run")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert "the target has random weights" in caplog.text
    assert main([*args[:args.index("--out") + 1], str(tmp_path / "real"), *args[args.index("--out") + 2:]]) != 0
    assert "safetensors" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--feature-cache with --load-format dummy"):
        _config(config_only, data, tmp_path / "x", "--steps", "1", "--load-format", "dummy", "--feature-cache",
                str(tmp_path / "cache"))


def test_peagle_train_arms_cuda_core_dumps_unless_the_caller_chose(tmp_path):
    from peagle.training.cli import arm_gpu_core_dumps

    environ = {}
    assert arm_gpu_core_dumps(tmp_path / "run", environ)
    assert environ["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1"
    assert environ["CUDA_ENABLE_LIGHTWEIGHT_COREDUMP"] == "1"  # the kernel and its warps, no memory contents
    assert environ["CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION"] == "0"  # no host core: the trainer records its fault
    assert environ["CUDA_COREDUMP_FILE"] == str((tmp_path / "run" / "faults").resolve() / "gpu-core.%p")
    assert (tmp_path / "run" / "faults").is_dir()  # CUDA writes into it, it does not make it

    for chosen in ("0", "1"):
        environ = {"CUDA_ENABLE_COREDUMP_ON_EXCEPTION": chosen}
        assert not arm_gpu_core_dumps(tmp_path / "other", environ)
        assert environ == {"CUDA_ENABLE_COREDUMP_ON_EXCEPTION": chosen}

