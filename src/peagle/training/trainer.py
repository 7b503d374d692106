"""The training loop: data -> frozen target -> drafter step, with schedules, logs, evaluation and checkpoints.

One optimizer step consumes a global batch of `batch_size x grad_accum x processes` packed sequences. Each
sequence's training elements are drawn with a generator seeded by (seed, epoch, sequence index), so the step does
not depend on how sequences are spread over processes and micro-batches, and a resumed run repeats exactly what
the uninterrupted one would have done.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import queue
import random
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from peagle.drafters.checkpoint import load_drafter, save_drafter
from peagle.drafters.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from peagle.drafters.drafter import Drafter
from peagle.drafters.target import TargetParts
from peagle.models.config import ModelConfig
from peagle.models.llama import LlamaModel
from peagle.models.loader import load_model, load_tokenizer, random_model
from peagle.models.tokenizer import Tokenizer
from peagle.training.cod import Layout
from peagle.training.config import (DEFAULT_DRAFT_VOCAB, FAULTS, GPU_CORE, TIME_LIMITED_WARMUP, TrainConfig,
                                    read_core_command)
from peagle.training.data import (Document, Manifest, PackedSequence, TrainingData, pack, read_documents,
                                  split_documents)
from peagle.training.distributed import DistContext
from peagle.training.flops import StepFlops, peak_flops
from peagle.training.forward import StepStats
from peagle.training.metrics import EvalStats
from peagle.training.objectives import Eagle3Objective, Objective, PEagleObjective, draft_to_target_ids
from peagle.training.optimizers import DrafterOptimizer
from peagle.training.mask import round_up
from peagle.training.plan import StepPlan
from peagle.training.teacher import FeatureCache, TeacherPass, run_target

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
FINAL = "final"
TRAINER_STATE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
CONFIG_FILE = "train_config.json"
FAULT_RECORD, FAULT_PLANS = "fault.json", "plans.pt"


def make_objective(cfg: TrainConfig) -> Objective:
    if cfg.method == "peagle":
        return PEagleObjective(cfg.k_train, cfg.cod_r, cfg.cod_r_min, cfg.num_segments, cfg.loss_chunk,
                               cfg.depth_decay, cfg.shape_multiple)
    return Eagle3Objective(cfg.k_train, cfg.loss_chunk, cfg.depth_decay, cfg.shape_multiple)


def gpu_core_file(out: Path) -> Path | None:
    """This process's GPU core dump under <out>/faults (armed by `peagle train`), if CUDA wrote one."""
    core = Path(out) / FAULTS / f"{GPU_CORE}.{os.getpid()}"
    return core if core.is_file() else None


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup to the peak over `warmup` steps, then linear or cosine decay to zero at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


# With --time-limit, the step rate is measured over these steps (after compilation), during the default warmup.
FIT_FROM, FIT_TO = 10, TIME_LIMITED_WARMUP
PROFILE_FROM = 5  # --profile-steps starts after this many steps (first-step compilation is not what to profile)
PROFILE_FILE = "profile.txt"
CUPTI_TEARDOWN_ENV = "TEARDOWN_CUPTI"  # read by the profiler when it stops
FIT_RESERVE = 0.05  # share of the remaining time kept for evaluation and saving
REFIT_EVERY = 50  # after the first fit, the horizon is fitted again to the rate of each window of this many steps


def fitted_total_steps(step: int, total: int, seconds_per_step: float, seconds_left: float) -> int:
    """The schedule's horizon under a time limit: the steps that fit in the time left at the measured rate, never
    more than asked for. The learning rate then decays to zero when the time runs out, not at a step never reached."""
    reachable = step + int(seconds_left * (1.0 - FIT_RESERVE) / max(seconds_per_step, 1e-9))
    return max(step + 1, min(total, reachable))


NOISE_SEED = 7919  # offsets --seed for the feature noise, so that it does not repeat the COD sampling's stream


def sequence_seed(seed: int, epoch: int, index: int) -> int:
    return (seed * 1_000_003 + epoch * 998_244_353 + index) % (1 << 62)


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """One optimizer step's work for this process, planned on the host."""

    epoch: int  # the data position after this step
    index: int
    plans: tuple[StepPlan, ...]  # one per micro-batch
    weight: float  # this process's share of the loss denominator
    counts: torch.Tensor  # [3] float64 (pinned on CUDA): weight, elements (positions) and tokens of this process
    flops: float


class Prefetcher:
    """Plans the next steps in a background thread while the device runs the current one.

    Planning (COD sampling, the partition, teacher rows, pinned copies) is pure host work in the order the steps
    will run, so the plans, and a resumed run's, are the same as planning them inline."""

    def __init__(self, trainer: "Trainer", depth: int = 3):
        self.trainer = trainer
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="plan-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        epoch, index = self.trainer.epoch, self.trainer.index
        try:
            while not self.stop.is_set():
                step = self.trainer.prepare(epoch, index)
                epoch, index = step.epoch, step.index
                while not self.stop.is_set():
                    try:
                        self.queue.put(step, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
            self.queue.put(e)

    def next(self) -> PreparedStep:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class Trainer:
    def __init__(self, cfg: TrainConfig, target: LlamaModel, drafter: Drafter, data: TrainingData,
                 held_out: list[PackedSequence], dist: DistContext, held_source: list[int] | None = None,
                 eval_data: list[PackedSequence] | None = None, eval_source: list[int] | None = None):
        """`held_source[i]`: the --data directory of held-out document i (the `sources` of `held_out`'s packs);
        `eval_data` and `eval_source` the same for the --eval-data directories' documents."""
        self.cfg, self.target, self.drafter, self.data, self.held_out, self.dist = (
            cfg, target, drafter, data, held_out, dist)
        self.held_source = held_source
        self.eval_data, self.eval_source = eval_data or [], eval_source
        self.objective = make_objective(cfg)
        self.aux_layer_ids = drafter.config.aux_layer_ids
        self.global_batch = cfg.batch_size * cfg.grad_accum * dist.world_size
        per_epoch = data.steps_per_epoch(self.global_batch)
        if per_epoch == 0:
            raise ValueError(
                f"the training data packs into {len(data.epoch(0))} sequences of --max-length {cfg.max_length}, "
                f"fewer than one step needs ({self.global_batch} = batch size x grad accum x processes)"
            )
        self.total_steps = cfg.steps if cfg.steps is not None else max(1, round(cfg.epochs * per_epoch))
        self.requested_steps = self.total_steps
        warmup = cfg.warmup(self.total_steps)
        self.optimizer = DrafterOptimizer(drafter, cfg.optimizer, cfg.lr, cfg.weight_decay,
                                          lambda s: lr_factor(s, warmup, self.total_steps, cfg.schedule),
                                          muon_lr=cfg.muon_lr, fused=dist.device.type == "cuda")
        self.params = self.optimizer.params
        self.step, self.epoch, self.index = 0, 0, 0
        self.schedule_fitted = False
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dist.device.type == "cuda")
        self.cache = FeatureCache(cfg.feature_cache, target, _cache_identity(cfg, self.aux_layer_ids, target)
                                  ) if cfg.feature_cache else None
        self.vocab_map = draft_to_target_ids(drafter)
        self.flops = StepFlops.of(target, drafter)
        self.device_name = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "cpu"
        self.peak_flops = peak_flops(dist.device) * dist.world_size if peak_flops(dist.device) else None
        self._pending: list[tuple[dict, torch.Tensor]] = []  # train rows whose device values are not read yet
        self._unsynced: list[tuple[int, int, int]] = []  # (step, epoch, index) of steps the device may not have run
        self._interval_start = None
        self._prefetch: Prefetcher | None = None
        self._stop = False
        self._profiler = None
        self._log_file = None
        self._tensorboard = None

    # ---- the loop ----

    def train(self) -> int:
        """Runs to `total_steps` (or a SIGTERM); returns the exit status."""
        if self.cfg.resume:
            self._load_latest()
        self._open_logs()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        limit = self.cfg.time_limit_minutes
        deadline = time.monotonic() + 60 * limit if limit is not None else None
        logger.info("training %s drafter: steps %d..%d of %d, global batch %d sequences",
                    self.cfg.method, self.step + 1, self.total_steps, self.total_steps, self.global_batch)
        first_step, fit_start = self.step, None  # fit_start: (step, time) where the current rate window began
        self._prefetch = Prefetcher(self, self.cfg.prefetch_steps) if self.cfg.prefetch_steps else None
        self._interval_start = time.monotonic()
        try:
            while self.step < self.total_steps:
                if self.cfg.profile_steps and self.step - first_step == PROFILE_FROM:
                    self._start_profile()
                self.train_step()
                self.step += 1
                if self._profiler is not None and self.step - first_step == PROFILE_FROM + self.cfg.profile_steps:
                    self._finish_profile()
                if self.step % self.cfg.log_every == 0:
                    self._flush()
                if deadline is not None:
                    # The rate is measured over steps FIT_FROM..FIT_TO, then again over every REFIT_EVERY steps:
                    # the GPU may be shared with other work that starts or ends, and the horizon follows the rate.
                    done = self.step - first_step
                    if done == FIT_FROM:
                        self._flush()  # the window starts with the device caught up
                        fit_start = (self.step, time.monotonic())
                    elif fit_start is not None and (done == FIT_TO or (
                            done > FIT_TO and self.step - fit_start[0] == REFIT_EVERY)):
                        self._flush()
                        now = time.monotonic()
                        self._fit_schedule((now - fit_start[1]) / (self.step - fit_start[0]), deadline)
                        fit_start = (self.step, now)
                if self.step % self.cfg.eval_every == 0 and self.evaluates:
                    self._flush()
                    self._log({"kind": "eval", "step": self.step, **self.evaluate()})
                stop, out_of_time = self._agreed_stop(deadline)
                if self.step % self.cfg.save_every == 0 or stop:
                    self._flush()
                    self.save_checkpoint()
                if stop:
                    logger.warning("SIGTERM: saved step %d; resume with --resume", self.step)
                    return 143
                if out_of_time:
                    logger.warning("time limit of %g minutes reached after step %d of %d; finishing", limit,
                                   self.step, self.total_steps)
                    break
            self._flush()
            if self.evaluates and self.step % self.cfg.eval_every:
                self._log({"kind": "eval", "step": self.step, **self.evaluate()})
            if self.dist.is_main:
                save_drafter(self.drafter, self.cfg.out / FINAL, force=True)
                logger.info("saved the trained drafter to %s", self.cfg.out / FINAL)
            return 0
        except Exception as e:
            if is_device_fault(e):
                if self._prefetch is not None:
                    self._prefetch.close()
                try:
                    self.record_fault(e)
                except Exception as record_error:  # noqa: BLE001 - the fault, not the record's failure, is the error
                    logger.error("could not record the fault's steps: %s", record_error)
            raise
        finally:
            if self._prefetch is not None:
                self._prefetch.close()
            self._prefetch = None
            if self._profiler is not None:
                self._finish_profile()
            signal.signal(signal.SIGTERM, previous)
            self._close_logs()

    def batch_at(self, epoch: int, index: int) -> tuple[list[tuple[int, int, PackedSequence]], int, int]:
        """The global batch that starts at data position (epoch, index), and the position after it."""
        sequences = self.data.epoch(epoch)
        if index + self.global_batch > len(sequences):
            epoch, index = epoch + 1, 0
            sequences = self.data.epoch(epoch)
        batch = [(epoch, index + j, sequences[index + j]) for j in range(self.global_batch)]
        return batch, epoch, index + self.global_batch

    def prepare(self, epoch: int, index: int, pin: bool = True) -> PreparedStep:
        """Host work of the step at data position (epoch, index): this process's micro-batches, planned (in pinned
        memory on CUDA unless `pin` is False)."""
        batch, epoch, index = self.batch_at(epoch, index)
        per_rank = self.cfg.batch_size * self.cfg.grad_accum
        mine = batch[self.dist.rank * per_rank:(self.dist.rank + 1) * per_rank]
        plans = tuple(self._plan(mine[i:i + self.cfg.batch_size]) for i in range(0, per_rank, self.cfg.batch_size))
        weight = sum(p.weight_sum for p in plans)
        counts = torch.tensor([weight, sum(p.num_elements for p in plans), sum(len(p.sequence) for p in plans)],
                              dtype=torch.float64)
        if pin and self.dist.device.type == "cuda":
            plans, counts = tuple(plan.pinned() for plan in plans), counts.pin_memory()
        return PreparedStep(epoch, index, plans, weight, counts,
                            sum(self.flops.step(p) for p in plans))

    def train_step(self) -> None:
        """One optimizer step. Nothing in it waits for the device: its values are read by `_flush`."""
        if self.dist.device.type == "cuda" and not self._pending:
            torch.cuda.reset_peak_memory_stats(self.dist.device)
        prepared = self._prefetch.next() if self._prefetch is not None else self.prepare(self.epoch, self.index)
        self._unsynced.append((self.step + 1, self.epoch, self.index))
        self.epoch, self.index = prepared.epoch, prepared.index
        self.run_step(prepared)

    def run_step(self, prepared: PreparedStep) -> None:
        """The device work of one prepared step, the optimizer's step included; its values join `_pending`."""
        counts = prepared.counts.to(self.dist.device, non_blocking=True)
        if self.dist.world_size > 1:  # the global denominator, summed on the device: no wait
            denominator = self.dist.all_reduce(counts[0].clone()).clamp(min=1.0)
        else:
            denominator = max(prepared.weight, 1.0)
        stats = StepStats.zero(self.cfg.k_train, self.dist.device)
        for plan in prepared.plans:
            teacher = self._noisy(self._teacher(plan.sequence), plan.noise_seeds)
            with self.autocast:
                stats = stats + self.objective.backward(self.drafter, self.target, teacher,
                                                        plan.to(self.dist.device), denominator, self.vocab_map)
        self.dist.all_reduce_grads(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        lr = self.optimizer.lr
        self.optimizer.step()
        self.optimizer.zero_grad()
        # The gradient norm is the same on every process; the sum over processes in _flush is divided back.
        values = torch.cat([stats.loss.double().view(1), grad_norm.double().view(1) / self.dist.world_size,
                            counts[1:], stats.total.double(), stats.correct.double()])
        self._pending.append(({"kind": "train", "step": self.step + 1, "lr": lr, "epoch": self.epoch,
                               "flops": prepared.flops}, values))

    def _flush(self) -> None:
        """Reads the pending steps' values from the device (one wait) and logs a row per step, with the interval's
        rates: tokens/s, positions/s, model-FLOP utilisation and the GPU's busy share."""
        if not self._pending:
            return
        values = self.dist.all_reduce(torch.stack([v for _, v in self._pending])).cpu()
        self._unsynced = []  # the device has finished every step so far
        now = time.monotonic()
        elapsed = max(now - self._interval_start, 1e-9)
        self._interval_start = now
        k = self.cfg.k_train
        steps = len(self._pending)
        flops = sum(r["flops"] for r, _ in self._pending) * self.dist.world_size
        rates = {
            "positions_per_s": float(values[:, 2].sum()) / elapsed, "tokens_per_s": float(values[:, 3].sum()) / elapsed,
            "step_s": elapsed / steps, "mfu": round(flops / elapsed / self.peak_flops, 4) if self.peak_flops else None,
            "gpu_busy": _gpu_busy(self.dist.device), "peak_memory_gb": _peak_memory_gb(self.dist.device),
        }
        for (record, _), row in zip(self._pending, values):
            stats = StepStats(row[0], row[4:4 + k].long(), row[4 + k:].long())
            self._log({"kind": record["kind"], "step": record["step"], "loss": float(row[0]),
                       "acc": _round(stats.accuracy()), "lr": record["lr"], "grad_norm": float(row[1]),
                       "epoch": record["epoch"], **rates})
        self._pending = []

    def _teacher(self, seq: PackedSequence) -> TeacherPass:
        if self.cache is not None:
            return self.cache.run(seq, self.aux_layer_ids, self.dist.device)
        pad, multiple = None, self.cfg.shape_multiple
        if self.cfg.pad_target_pass:
            pad = self.cfg.batch_size * self.cfg.max_length
        elif multiple:
            pad = round_up(len(seq.token_ids), multiple)
        return run_target(self.target, seq, self.aux_layer_ids, self.dist.device, pad_to=pad)

    def _noisy(self, teacher: TeacherPass, seeds: tuple[tuple[int, int], ...]) -> TeacherPass:
        """The teacher pass with Gaussian noise of std --feature-noise on its features (training only). Each packed
        sequence draws its own noise from a generator seeded by (seed, epoch, index): the same noise however the
        sequences are batched, split over processes or resumed."""
        if not self.cfg.feature_noise:
            return teacher
        features = teacher.features
        noise = torch.cat([
            torch.randn((length, features.shape[1]), generator=torch.Generator(features.device).manual_seed(seed),
                        device=features.device, dtype=torch.float32)
            for seed, length in seeds])
        noisy = (features.float() + self.cfg.feature_noise * noise).to(features.dtype)
        return TeacherPass(teacher.sequence, noisy, teacher.hidden)

    def _plan(self, part: list[tuple[int, int, PackedSequence]]) -> StepPlan:
        layouts = []
        for epoch, index, seq in part:
            gen = torch.Generator().manual_seed(sequence_seed(self.cfg.seed, epoch, index))
            layouts.append(self.objective.sample_layout(seq, gen))
        seqs = [seq for _, _, seq in part]
        layout = Layout.concat(layouts, [len(s) for s in seqs], [len(s.doc_lengths) for s in seqs])
        seeds = tuple((sequence_seed(self.cfg.seed + NOISE_SEED, epoch, index), len(seq)) for epoch, index, seq in part)
        return replace(self.objective.plan(PackedSequence.concat(seqs), layout), noise_seeds=seeds)

    # ---- evaluation ----

    @property
    def evaluates(self) -> bool:
        return bool(self.held_out or self.eval_data)

    def evaluate(self) -> dict:
        """Per-depth accuracy, the simulated acceptance length and the serving walk's acceptance length
        (`metrics.py`) on held-out sequences, at every K up to K_train; the --eval-data directories' scores apart,
        as `eval_data` (the same fields)."""
        row = self._scores(self.held_out, self.held_source, source_names(self.cfg.data)) if self.held_out else {}
        if self.eval_data:
            row["eval_data"] = self._scores(self.eval_data, self.eval_source, source_names(self.cfg.eval_data))
        return row

    def _scores(self, sequences: list[PackedSequence], sources: list[int] | None, names: list[str]) -> dict:
        """The scores of `sequences`; `sources[i]` is the index in `names` of their document i."""
        k = self.cfg.k_train
        groups = len(names) if sources is not None else 0
        total = EvalStats(StepStats.zero(k), torch.zeros(k + 1, dtype=torch.long), torch.zeros(k, 2, dtype=torch.long),
                          torch.zeros(groups, k, 2, dtype=torch.long))
        self.drafter.eval()
        for seq in sequences[self.dist.rank::self.dist.world_size]:
            teacher = run_target(self.target, seq, self.aux_layer_ids, self.dist.device)
            doc_groups = [sources[i] for i in seq.sources] if groups and seq.sources else None
            with self.autocast:
                result = self.objective.evaluate(self.drafter, self.target, teacher, self.vocab_map, doc_groups,
                                                 groups, self.cfg.walk_max_tokens or None)
            total = total + EvalStats(StepStats(result.stats.loss.cpu(), result.stats.total.cpu(),
                                                result.stats.correct.cpu()), result.leading, result.walked,
                                      result.walked_groups)
        self.drafter.train()
        flat = torch.cat([total.stats.loss.double().view(1), total.stats.total.double(),
                          total.stats.correct.double(), total.leading.double(), total.walked.double().flatten(),
                          total.walked_groups.double().flatten()])
        flat = self.dist.all_reduce(flat.to(self.dist.device)).cpu()
        stats = StepStats(flat[0], flat[1:1 + k].long(), flat[1 + k:1 + 2 * k].long())
        walked_end = 2 + 5 * k
        result = EvalStats(stats, flat[1 + 2 * k:2 + 3 * k].long(), flat[2 + 3 * k:walked_end].long().view(k, 2),
                           flat[walked_end:].long().view(groups, k, 2))
        charged = int(stats.total.sum())
        row = {
            "loss": float(stats.loss) / max(charged, 1), "acc": _round(stats.accuracy()),
            "cond_acc": _round(result.conditional_accuracy()),
            "sim_al": {str(j): round(result.acceptance_length(j), 4) for j in range(1, k + 1)},
            "walk_al": {str(j): round(result.walk_acceptance_length(j), 4) for j in range(1, k + 1)},
            "rollouts": int(result.leading.sum()), "rounds": int(result.walked[-1, 1]),
            "walk_max_tokens": self.cfg.walk_max_tokens,
        }
        if groups:
            row["walk_al_by_source"] = {
                name: {str(j): round(result.walk_acceptance_length(j, g), 4) for j in range(1, k + 1)}
                for g, name in enumerate(names) if int(result.walked_groups[g, -1, 1])}
        return row

    # ---- checkpoints ----

    def save_checkpoint(self) -> None:
        if not self.dist.is_main:
            return
        root = self.cfg.out / CHECKPOINTS
        path = root / f"step-{self.step:08d}"
        save_drafter(self.drafter, path, force=True)
        state = {
            "step": self.step, "epoch": self.epoch, "index": self.index, "total_steps": self.total_steps,
            "schedule_fitted": self.schedule_fitted,
            "global_batch": self.global_batch,
            "drafter": self.drafter.state_dict(), "optimizers": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }
        tmp = path / (TRAINER_STATE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path / TRAINER_STATE)  # the checkpoint counts as complete only once this file exists
        for old in complete_checkpoints(root)[:-self.cfg.keep_checkpoints]:
            shutil.rmtree(old)
        logger.info("checkpoint %s", path)

    def _load_latest(self) -> None:
        found = complete_checkpoints(self.cfg.out / CHECKPOINTS)
        if not found:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.cfg.out / CHECKPOINTS}")
        state = torch.load(found[-1] / TRAINER_STATE, map_location="cpu", weights_only=False)
        if state["global_batch"] != self.global_batch:
            raise ValueError(
                f"the checkpoint was trained with a global batch of {state['global_batch']} sequences, this run "
                f"has {self.global_batch}; resume with the same batch size, grad accum and process count"
            )
        self.drafter.load_state_dict(state["drafter"])
        if "optimizers" in state:
            self.optimizer.load_state_dict(state["optimizers"])
        else:  # a checkpoint from before --optimizer: one AdamW
            self.optimizer.load_legacy(state["optimizer"], state["scheduler"])
        self.step, self.epoch, self.index = state["step"], state["epoch"], state["index"]
        if state.get("schedule_fitted"):  # a horizon fitted to an earlier run's time limit stays
            self.total_steps, self.schedule_fitted = state["total_steps"], True
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        logger.info("resumed from %s at step %d", found[-1], self.step)

    # ---- device faults ----

    def fault_dir(self) -> Path:
        first = self._unsynced[0][0] if self._unsynced else self.step + 1
        rank = f"-rank{self.dist.rank}" if self.dist.world_size > 1 else ""
        return self.cfg.out / FAULTS / f"step-{first:08d}{rank}"

    def record_fault(self, error: BaseException) -> Path:
        """Writes the steps the device had not finished when it faulted (one of them faulted: an error reported by
        CUDA surfaces at a later call), for `peagle train-replay`: fault.json (the error, each step's data position
        and shapes, the host RNG states) and plans.pt (each step planned again on the host from its position, which
        gives the plan it ran: planning depends on the position alone). Touches no device memory."""
        steps = self._unsynced or [(self.step + 1, self.epoch, self.index)]
        prepared = [self.prepare(epoch, index, pin=False) for _, epoch, index in steps]
        out = self.fault_dir()
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"steps": [{"step": step, "epoch": epoch, "index": index, "prepared": p}
                              for (step, epoch, index), p in zip(steps, prepared)],
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}, out / FAULT_PLANS)
        record = {
            "error": f"{type(error).__name__}: {error}".strip(), "method": self.cfg.method,
            "torch": torch.__version__, "device": self.device_name,
            "steps": [{"step": step, "epoch": epoch, "index": index, **plan_shapes(p)}
                      for (step, epoch, index), p in zip(steps, prepared)],
            "replay": f"peagle train-replay {out}",
        }
        core = gpu_core_file(self.cfg.out)
        if core is not None:  # written by CUDA at the exception (`peagle train` arms it): it names the kernel
            record["gpu_core"] = str(core)
            record["read_core"] = read_core_command(core)

        if not self._unsynced:  # every step had finished: an evaluation or a save faulted; the next step is kept
            record["note"] = "no training step was in flight: the fault arose in an evaluation or a checkpoint save"
        (out / FAULT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        logger.error("device fault within steps %d..%d; their plans are in %s (replay: peagle train-replay %s)",
                     steps[0][0], steps[-1][0], out, out)
        return out

    def replay(self, fault_dir: Path, history: int = 0) -> list[dict]:
        """Runs each step recorded in `fault_dir` alone, waiting for the device after each: one row per step, with
        its loss, or the error of the step that faulted (the steps after it are not run).

        `history`: first the run's first `history` steps from the start of its data, so that the compiled kernels
        meet the shapes in the order the run met them (a kernel compiled for an early shape, reused later); their
        rows say "history". The drafter and optimizers are restored after them: the recorded steps start from the
        same state either way."""
        record = torch.load(Path(fault_dir) / FAULT_PLANS, map_location="cpu", weights_only=False)
        saved = copy.deepcopy({"drafter": self.drafter.state_dict(), "optimizers": self.optimizer.state_dict()}
                              ) if history else None
        rows, position = [], (0, 0)
        steps = [(i + 1, None, True) for i in range(history)] + [(e["step"], e, False) for e in record["steps"]]
        for number, entry, early in steps:
            prepared = self.prepare(*position) if early else entry["prepared"]
            at = position if early else (entry["epoch"], entry["index"])
            row = {"step": number, "epoch": at[0], "index": at[1], **({"history": True} if early else {})}
            try:
                self.run_step(prepared)
                if self.dist.device.type == "cuda":
                    torch.cuda.synchronize(self.dist.device)
                loss = float(self._pending.pop()[1][0])
            except Exception as e:  # noqa: BLE001 - the fault is the result; any other error is one too
                rows.append({**row, "error": f"{type(e).__name__}: {e}".strip()})
                break
            rows.append({**row, "error": None, "loss": loss})
            if early:
                position = (prepared.epoch, prepared.index)
                if number == history:
                    self.drafter.load_state_dict(saved["drafter"])
                    self.optimizer.load_state_dict(saved["optimizers"])
        return rows

    # ---- signals and logs ----

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dist.device.type == "cuda" else [])
        # The CUDA tracer stays attached after it stops unless TEARDOWN_CUPTI=1, slowing every later launch (PyTorch
        # issue 144455; docs/DECISIONS.md); teardown is unsafe only beside CUDA graphs, which training does not use.
        os.environ.setdefault(CUPTI_TEARDOWN_ENV, "1")
        self._profiler = profile(activities=activities)
        self._profiler.start()
        self._profiled_from = self.step + 1

    def _finish_profile(self) -> None:
        prof, self._profiler = self._profiler, None
        prof.stop()
        if not self.dist.is_main:
            return
        device_time = "self_device_time_total" if self.dist.device.type == "cuda" else "self_cpu_time_total"
        header = (f"torch.profiler over steps {self._profiled_from}..{self.step} of a {self.cfg.method} run "
                  f"(max length {self.cfg.max_length}, batch {self.cfg.batch_size}), sorted by {device_time}\n\n")
        table = prof.key_averages().table(sort_by=device_time, row_limit=40, max_name_column_width=60)
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        (self.cfg.out / PROFILE_FILE).write_text(header + table + "\n")
        logger.info("profile of steps %d..%d written to %s", self._profiled_from, self.step,
                    self.cfg.out / PROFILE_FILE)

    def _fit_schedule(self, seconds_per_step: float, deadline: float) -> None:
        # Every process takes the main process's horizon, so that all run the same number of steps.
        mine = fitted_total_steps(self.step, self.requested_steps, seconds_per_step, deadline - time.monotonic())
        value = torch.tensor([float(mine if self.dist.is_main else 0)], device=self.dist.device)
        fitted = int(self.dist.all_reduce(value).item())
        self.schedule_fitted = True
        if fitted != self.total_steps:
            self._log({"kind": "schedule", "step": self.step, "total_steps": fitted,
                       "requested_steps": self.requested_steps, "seconds_per_step": seconds_per_step})
            self.total_steps = fitted

    def _agreed_stop(self, deadline: float | None) -> tuple[bool, bool]:
        # Every process must stop after the same step, or the next all-reduce would hang; they agree at the end of
        # each logging interval, where they wait for the device anyway.
        out_of_time = deadline is not None and time.monotonic() > deadline
        if self.dist.world_size == 1:
            return self._stop, out_of_time
        if self.step % self.cfg.log_every:
            return False, False
        flags = torch.tensor([float(self._stop), float(out_of_time)], device=self.dist.device)
        sigterm, timeout = (self.dist.all_reduce(flags) > 0).tolist()
        return sigterm, timeout

    def _open_logs(self) -> None:
        if not self.dist.is_main:
            return
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        self._log_file = (self.cfg.out / LOG_FILE).open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.info("tensorboard is not installed; logging to %s only", self.cfg.out / LOG_FILE)
        else:
            self._tensorboard = SummaryWriter(str(self.cfg.out / "tensorboard"))

    def _close_logs(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def _log(self, record: dict) -> None:
        if not self.dist.is_main:
            return
        self._log_file.write(json.dumps(record) + "\n")
        self._log_file.flush()
        kind, step = record["kind"], record["step"]
        if kind == "schedule":
            logger.info("--time-limit: %.3f s per step, so the schedule ends at step %d instead of %d",
                        record["seconds_per_step"], record["total_steps"], record["requested_steps"])
        elif kind == "train":
            logger.info("step %d/%d loss %.4f acc %s lr %.2e %.0f tokens/s %.0f positions/s", step,
                        self.total_steps, record["loss"], record["acc"][:4], record["lr"], record["tokens_per_s"],
                        record["positions_per_s"])
        elif kind == "eval":
            k = str(self.cfg.k_train)
            parts = [f"eval at step {step}:"]
            if "walk_al" in record:
                parts.append(f"loss {record['loss']:.4f} acc {record['acc'][:4]} "
                             f"walk AL@{k} {record['walk_al'][k]:.3f} (simulated {record['sim_al'][k]:.3f})")
            if "eval_data" in record:
                parts.append(f"--eval-data walk AL@{k} {record['eval_data']['walk_al'][k]:.3f}")
            logger.info("%s", " ".join(parts))
        if self._tensorboard is not None:
            for key, value in _scalars(record):
                self._tensorboard.add_scalar(f"{kind}/{key}", value, step)


def is_device_fault(error: BaseException) -> bool:
    """Whether an exception is a CUDA error reported by the device (a kernel's fault, not a Python mistake)."""
    accelerator = getattr(torch, "AcceleratorError", None)
    return (accelerator is not None and isinstance(error, accelerator)) or (
        isinstance(error, RuntimeError) and "CUDA error" in str(error))


def plan_shapes(prepared: PreparedStep) -> dict:
    """What a step's kernels saw: per micro-batch its tokens, documents, and per forward its elements by depth,
    padded rows, charged elements and block-mask tiles."""
    return {"micro_batches": [{
        "tokens": len(plan.sequence), "documents": len(plan.sequence.doc_lengths),
        "teacher_rows": plan.teacher_positions.numel(),
        "forwards": [{"elements": len(f.layout), "depth_counts": list(f.depth_counts), "rows": f.rows,
                      "charged": f.charged.numel(), "tiles": [list(t.kv_idx.shape[-2:]) for t in f.tiles]}
                     for f in plan.forwards]} for plan in prepared.plans]}


def _cache_identity(cfg: TrainConfig, aux_layer_ids, target: LlamaModel) -> dict:
    # Cached documents are keyed by their index among the training documents, which the split decides.
    return {"target": str(cfg.target.resolve()), "dtype": str(target.embed_tokens.weight.dtype),
            "aux_layer_ids": list(aux_layer_ids), "data": [str(d.resolve()) for d in cfg.data],
            "max_length": cfg.max_length,
            "split": [cfg.seed, cfg.eval_fraction, cfg.max_eval_documents]}


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories with their trainer state written, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file())


def _gpu_busy(device: torch.device) -> float | None:
    """The share of the last sampling period (1/6 to 1 s) in which a kernel ran on the GPU, from NVML."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.utilization(device) / 100.0
    except Exception:  # noqa: BLE001 - NVML (nvidia-ml-py) missing or not permitted: the value is optional
        return None


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def _round(values: list[float]) -> list[float]:
    return [round(v, 4) if v == v else None for v in values]


def _scalars(record: dict, prefix: str = ""):
    """(tag, number) for every number in a log record, nested lists and dicts (walk_al_by_source) flattened."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, bool) or (key in ("kind", "step") and not prefix):
            continue
        if isinstance(value, (int, float)):
            yield tag, value
        elif isinstance(value, list):
            yield from _scalars({str(i + 1): v for i, v in enumerate(value)}, f"{tag}/")
        elif isinstance(value, dict):
            yield from _scalars(value, f"{tag}/")


def config_record(cfg: TrainConfig) -> dict:
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v

    return {k: plain(v) for k, v in asdict(cfg).items()}


def config_from_record(record: dict) -> TrainConfig:
    """The TrainConfig that `config_record` wrote (a run's train_config.json)."""
    paths = {"target", "out", "init", "feature_cache"}
    value = {k: (Path(v) if k in paths and v is not None else v) for k, v in record.items()}
    value["data"] = tuple(Path(d) for d in (record["data"] if isinstance(record["data"], list) else [record["data"]]))
    value["eval_data"] = tuple(Path(d) for d in record.get("eval_data", ()))
    if value.get("aux_layer_ids") is not None:
        value["aux_layer_ids"] = tuple(value["aux_layer_ids"])
    return TrainConfig(**value)


def replay_fault(fault_dir: Path, dist: DistContext, history: int = 0) -> list[dict]:
    """Each step recorded in `fault_dir` (`Trainer.record_fault`) run alone on `dist`'s device, from the run's
    newest checkpoint (else the drafter the run started from), after `history` of the run's first steps: one row per
    step run (`Trainer.replay`)."""
    if history < 0:
        raise ValueError(f"history must be >= 0 steps, got {history}")
    fault_dir = Path(fault_dir)
    if not (fault_dir / FAULT_PLANS).is_file():
        raise FileNotFoundError(f"{fault_dir} holds no {FAULT_PLANS}: give a directory the trainer wrote under "
                                f"<--out>/{FAULTS}/ after a device fault")
    run = fault_dir.parent.parent
    if not (run / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run} holds no {CONFIG_FILE}: the fault directory must stay inside its run's "
                                f"--out directory ({FAULTS}/step-N)")
    cfg = config_from_record(json.loads((run / CONFIG_FILE).read_text()))
    resumed = bool(complete_checkpoints(run / CHECKPOINTS))
    trainer = build_trainer(replace(cfg, out=run, resume=resumed), dist, write_config=False)
    if resumed:
        trainer._load_latest()
    return trainer.replay(fault_dir, history)


def split_sources(data_dirs, tokenizer: Tokenizer, vocab_size: int, eval_fraction: float, max_eval: int,
                  seed: int) -> tuple[list[Document], list[Document], list[int]]:
    """(train, held_out, held_source) documents of several data directories; held_source[i] is the index in
    `data_dirs` of held-out document i. Each source is held out from, so that the held-out scores speak for the
    whole mixture: `max_eval` documents at most, shared out between the sources."""
    train_docs, held_docs, held_source = [], [], []
    for i, data_dir in enumerate(data_dirs):
        share = max_eval // len(data_dirs) + (i < max_eval % len(data_dirs))
        train, held = split_documents(read_documents(data_dir, tokenizer, vocab_size), eval_fraction, share, seed)
        train_docs += train
        held_docs += held
        held_source += [i] * len(held)
    return train_docs, held_docs, held_source


MAX_SHARED_EVAL = 0.25  # the share of an --eval-data directory that may also be training data


def read_eval_data(eval_dirs, tokenizer: Tokenizer, vocab_size: int, max_docs: int, train_docs: list[Document]
                   ) -> tuple[list[Document], list[int]]:
    """(documents, source) of the --eval-data directories, the first `max_docs` documents of each that are not
    training documents; source[i] is the index in `eval_dirs` of document i. A document that is also a training
    document is left out of the scores (a short prompt such as "hi" can be a training prompt too, and the target
    answers it alike); a directory of which more than MAX_SHARED_EVAL of the documents are training documents is
    refused: it is not held out."""
    docs, source = [], []
    if not eval_dirs:
        return docs, source
    trained = {hash(d.token_ids.numpy().tobytes()) for d in train_docs}
    for i, data_dir in enumerate(eval_dirs):
        read = read_documents(data_dir, tokenizer, vocab_size)
        mine = [d for d in read if hash(d.token_ids.numpy().tobytes()) not in trained]
        shared = len(read) - len(mine)
        if shared > MAX_SHARED_EVAL * len(read):
            raise ValueError(f"{shared} of the {len(read)} documents read from --eval-data {data_dir} are training "
                             "documents too: evaluate on data that --data does not hold")
        if shared:
            logger.warning("--eval-data %s: %d of its %d documents are training documents too; scored without them",
                           data_dir, shared, len(read))
        mine = mine[:max_docs]
        docs += mine
        source += [i] * len(mine)
    return docs, source


def refuse_evaluation_sets(data_dirs) -> None:
    """--data never names an evaluation set (`peagle regenerate --eval-set`)."""
    for data_dir in data_dirs:
        if Manifest.read(Path(data_dir)).source.get("evaluation_only"):
            raise ValueError(f"{data_dir} is an evaluation set (written by `peagle regenerate --eval-set`) and is "
                             "never trained on: pass it as --eval-data")


def source_names(data_dirs) -> list[str]:
    """A short name per data directory (its folder name; the index added where two share one)."""
    names = [Path(d).name or str(d) for d in data_dirs]
    return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def build_trainer(cfg: TrainConfig, dist: DistContext, write_config: bool = True) -> Trainer:
    """Loads the target, the data and a drafter (fresh or --init) and checks that they fit together; records the
    configuration in the run's directory unless `write_config` is False."""
    target_config = ModelConfig.from_dir(cfg.target)
    if cfg.max_length > target_config.max_position_embeddings:
        raise ValueError(
            f"--max-length {cfg.max_length} is longer than the target supports "
            f"(max_position_embeddings {target_config.max_position_embeddings})"
        )
    if not cfg.resume and complete_checkpoints(cfg.out / CHECKPOINTS):
        raise FileExistsError(f"{cfg.out} already holds checkpoints; pass --resume to continue or choose another --out")
    tokenizer = load_tokenizer(cfg.target)
    refuse_evaluation_sets(cfg.data)
    train_docs, held_docs, held_source = split_sources(cfg.data, tokenizer, target_config.vocab_size,
                                                       cfg.eval_fraction, cfg.max_eval_documents, cfg.seed)
    eval_docs, eval_source = read_eval_data(cfg.eval_data, tokenizer, target_config.vocab_size,
                                            cfg.max_eval_data_documents, train_docs)
    logger.info("%d training documents, %d held out%s", len(train_docs), len(held_docs),
                f", {len(eval_docs)} of --eval-data" if eval_docs else "")
    dtype = "bfloat16" if dist.device.type == "cuda" else "float32"
    if cfg.load_format == "dummy":
        logger.warning("--load-format dummy: the target has random weights; this run measures speed and memory, "
                       "its head is meaningless")
        target = random_model(target_config, getattr(torch, dtype), dist.device, cfg.seed)
    else:
        target = load_model(cfg.target, dtype, dist.device)
    if cfg.compile_elementwise:
        from peagle.training import compiled_ops

        compiled_ops.install(dist.device)
    drafter = _make_drafter(cfg, target, tokenizer, train_docs).to(dist.device)
    if dist.is_main and write_config:
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / CONFIG_FILE).write_text(json.dumps(config_record(cfg), indent=1) + "\n")
    held_out = pack(held_docs, range(len(held_docs)), cfg.max_length)
    eval_data = pack(eval_docs, range(len(eval_docs)), cfg.max_length)
    return Trainer(cfg, target, drafter, TrainingData(train_docs, cfg.max_length, cfg.seed), held_out, dist,
                   held_source, eval_data, eval_source)


def _answer_tokens(docs: list[Document]) -> torch.Tensor:  # [N] the loss-masked token ids of all documents
    return torch.cat([d.token_ids for d in docs])[torch.cat([d.loss_mask for d in docs])]


def _make_drafter(cfg: TrainConfig, target: LlamaModel, tokenizer: Tokenizer, train_docs: list[Document]
                  ) -> Drafter:
    if cfg.init is not None:
        drafter = load_drafter(cfg.init, target.config, dtype="float32", target=target)
        if drafter.config.method != cfg.method:
            raise ValueError(f"--init {cfg.init} is a {drafter.config.method} head but --method is {cfg.method}")
    else:
        parts = (TargetParts.of(target, tokenizer) if cfg.load_format == "dummy"
                 else TargetParts.from_dir(cfg.target, tokenizer))
        # A draft vocabulary as large as the target's is the target's own, in order (no frequency count needed).
        size = DEFAULT_DRAFT_VOCAB if cfg.draft_vocab_size is None else cfg.draft_vocab_size
        size = size if 0 < size < target.config.vocab_size else None
        # One sequence of every answer token: counting document by document cost minutes of small CPU ops on
        # the GPU machine with two trainers side by side.
        corpus = [_answer_tokens(train_docs)] if size else None
        drafter = Drafter.for_target(
            parts, cfg.method, cfg.layers,
            draft_vocab=size, vocab_corpus=corpus, aux_layer_ids=cfg.aux_layer_ids,
            num_speculative_tokens=min(cfg.k_train, DEFAULT_NUM_SPECULATIVE_TOKENS[cfg.method]), seed=cfg.seed,
        )
    drafter = drafter.float().requires_grad_(True).train()
    if cfg.freeze_lm_head:
        drafter.lm_head.weight.requires_grad_(False)
    if cfg.freeze_embeddings:
        freeze_embeddings(drafter)
    return drafter


def freeze_embeddings(drafter: Drafter) -> None:
    """Keep the token embedding at its rows (the target's, copied in `Drafter.for_target`), as SpecForge's recipes
    do. P-EAGLE's MASK slots read the row of mask_token_id, the method's learned mask-token embedding: that row alone
    keeps its gradient (Adam moves a row whose gradient is always zero by nothing, and the config refuses weight
    decay beside this). EAGLE-3's embedding takes no gradient at all."""
    weight = drafter.embed_tokens.weight
    row = drafter.config.mask_token_id if drafter.config.method == "peagle" else None
    if row is None:
        weight.requires_grad_(False)
        return

    def only_the_mask_row(grad: torch.Tensor) -> torch.Tensor:
        kept = torch.zeros_like(grad)
        kept[row] = grad[row]
        return kept

    weight.register_hook(only_the_mask_row)
