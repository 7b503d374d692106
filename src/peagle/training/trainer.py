"""The training loop: data -> frozen target -> drafter step, with schedules, logs, evaluation and checkpoints.

One optimizer step consumes a global batch of `batch_size x grad_accum x processes` packed sequences. Each
sequence's training elements are drawn with a generator seeded by (seed, epoch, sequence index), so the step does
not depend on how sequences are spread over processes and micro-batches, and a resumed run repeats exactly what
the uninterrupted one would have done.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

from peagle.drafters.checkpoint import load_drafter, save_drafter
from peagle.drafters.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from peagle.drafters.drafter import Drafter
from peagle.drafters.target import TargetParts
from peagle.models.config import ModelConfig
from peagle.models.llama import LlamaModel
from peagle.models.loader import load_model, load_tokenizer
from peagle.models.tokenizer import Tokenizer
from peagle.training.cod import Layout
from peagle.training.config import TIME_LIMITED_WARMUP, TrainConfig
from peagle.training.data import Document, PackedSequence, TrainingData, pack, read_documents, split_documents
from peagle.training.distributed import DistContext
from peagle.training.forward import StepStats
from peagle.training.objectives import Eagle3Objective, EvalStats, Objective, PEagleObjective
from peagle.training.teacher import FeatureCache, TeacherPass, run_target

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
FINAL = "final"
TRAINER_STATE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"


def make_objective(cfg: TrainConfig) -> Objective:
    if cfg.method == "peagle":
        return PEagleObjective(cfg.k_train, cfg.cod_r, cfg.cod_r_min, cfg.num_segments, cfg.loss_chunk)
    return Eagle3Objective(cfg.k_train, cfg.loss_chunk)


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
FIT_RESERVE = 0.05  # share of the remaining time kept for evaluation and saving
REFIT_EVERY = 50  # after the first fit, the horizon is fitted again to the rate of each window of this many steps


def fitted_total_steps(step: int, total: int, seconds_per_step: float, seconds_left: float) -> int:
    """The schedule's horizon under a time limit: the steps that fit in the time left at the measured rate, never
    more than asked for. The learning rate then decays to zero when the time runs out, not at a step never reached."""
    reachable = step + int(seconds_left * (1.0 - FIT_RESERVE) / max(seconds_per_step, 1e-9))
    return max(step + 1, min(total, reachable))


def sequence_seed(seed: int, epoch: int, index: int) -> int:
    return (seed * 1_000_003 + epoch * 998_244_353 + index) % (1 << 62)


class Trainer:
    def __init__(self, cfg: TrainConfig, target: LlamaModel, drafter: Drafter, data: TrainingData,
                 held_out: list[PackedSequence], dist: DistContext):
        self.cfg, self.target, self.drafter, self.data, self.held_out, self.dist = (
            cfg, target, drafter, data, held_out, dist)
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
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        warmup = cfg.warmup(self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, self.total_steps, cfg.schedule))
        self.step, self.epoch, self.index = 0, 0, 0
        self.schedule_fitted = False
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dist.device.type == "cuda")
        self.cache = FeatureCache(cfg.feature_cache, target, _cache_identity(cfg, self.aux_layer_ids, target)
                                  ) if cfg.feature_cache else None
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
        try:
            while self.step < self.total_steps:
                if self.cfg.profile_steps and self.step - first_step == PROFILE_FROM:
                    self._start_profile()
                record = self.train_step()
                self.step += 1
                if self._profiler is not None and self.step - first_step == PROFILE_FROM + self.cfg.profile_steps:
                    self._finish_profile()
                self._log({"kind": "train", "step": self.step, **record})
                if deadline is not None:
                    # The rate is measured over steps FIT_FROM..FIT_TO, then again over every REFIT_EVERY steps:
                    # the GPU may be shared with other work that starts or ends, and the horizon follows the rate.
                    done = self.step - first_step
                    if done == FIT_FROM:
                        fit_start = (self.step, time.monotonic())
                    elif fit_start is not None and (done == FIT_TO or (
                            done > FIT_TO and self.step - fit_start[0] == REFIT_EVERY)):
                        now = time.monotonic()
                        self._fit_schedule((now - fit_start[1]) / (self.step - fit_start[0]), deadline)
                        fit_start = (self.step, now)
                if self.step % self.cfg.eval_every == 0 and self.held_out:
                    self._log({"kind": "eval", "step": self.step, **self.evaluate()})
                stop, out_of_time = self._agreed_stop(deadline)
                if self.step % self.cfg.save_every == 0 or stop:
                    self.save_checkpoint()
                if stop:
                    logger.warning("SIGTERM: saved step %d; resume with --resume", self.step)
                    return 143
                if out_of_time:
                    logger.warning("time limit of %g minutes reached after step %d of %d; finishing", limit,
                                   self.step, self.total_steps)
                    break
            if self.held_out and self.step % self.cfg.eval_every:
                self._log({"kind": "eval", "step": self.step, **self.evaluate()})
            if self.dist.is_main:
                save_drafter(self.drafter, self.cfg.out / FINAL, force=True)
                logger.info("saved the trained drafter to %s", self.cfg.out / FINAL)
            return 0
        finally:
            if self._profiler is not None:
                self._finish_profile()
            signal.signal(signal.SIGTERM, previous)
            self._close_logs()

    def next_batch(self) -> list[tuple[int, int, PackedSequence]]:
        """The global batch of this step: (epoch, index, sequence), advancing the data position."""
        sequences = self.data.epoch(self.epoch)
        if self.index + self.global_batch > len(sequences):
            self.epoch, self.index = self.epoch + 1, 0
            sequences = self.data.epoch(self.epoch)
        batch = [(self.epoch, self.index + j, sequences[self.index + j]) for j in range(self.global_batch)]
        self.index += self.global_batch
        return batch

    def train_step(self) -> dict:
        start = time.perf_counter()
        if self.dist.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dist.device)
        batch = self.next_batch()
        per_rank = self.cfg.batch_size * self.cfg.grad_accum
        mine = batch[self.dist.rank * per_rank:(self.dist.rank + 1) * per_rank]
        micro = [mine[i:i + self.cfg.batch_size] for i in range(0, per_rank, self.cfg.batch_size)]
        plans = [self._plan(part) for part in micro]
        # The loss denominator is the charged weight of the whole global batch, known before any forward.
        local = torch.tensor([sum(float(lay.weight.sum()) for _, lay in plans), sum(len(lay) for _, lay in plans),
                              sum(len(seq) for seq, _ in plans)], dtype=torch.float64)
        weight, elements, tokens = self.dist.all_reduce(local.to(self.dist.device)).tolist()
        stats = StepStats.zero(self.cfg.k_train)
        for seq, layout in plans:
            teacher = self._teacher(seq)
            with self.autocast:
                stats = stats + self.objective.backward(self.drafter, self.target, teacher,
                                                        layout.to(self.dist.device), max(weight, 1.0))
        self.dist.all_reduce_grads(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = self._reduce(stats)
        elapsed = time.perf_counter() - start
        return {
            "loss": stats.loss, "acc": _round(stats.accuracy()), "lr": lr, "grad_norm": float(grad_norm),
            "epoch": self.epoch, "positions_per_s": elements / elapsed, "tokens_per_s": tokens / elapsed,
            "peak_memory_gb": _peak_memory_gb(self.dist.device), "step_s": elapsed,
        }

    def _teacher(self, seq: PackedSequence) -> TeacherPass:
        if self.cache is not None:
            return self.cache.run(seq, self.aux_layer_ids, self.dist.device)
        return run_target(self.target, seq, self.aux_layer_ids, self.dist.device)

    def _plan(self, part: list[tuple[int, int, PackedSequence]]) -> tuple[PackedSequence, Layout]:
        layouts = []
        for epoch, index, seq in part:
            gen = torch.Generator().manual_seed(sequence_seed(self.cfg.seed, epoch, index))
            layouts.append(self.objective.sample_layout(seq, gen))
        seqs = [seq for _, _, seq in part]
        layout = Layout.concat(layouts, [len(s) for s in seqs], [len(s.doc_lengths) for s in seqs])
        return PackedSequence.concat(seqs), layout

    def _reduce(self, stats: StepStats) -> StepStats:
        flat = torch.cat([torch.tensor([stats.loss], dtype=torch.float64), stats.total.double(),
                          stats.correct.double()]).to(self.dist.device)
        flat = self.dist.all_reduce(flat).cpu()
        k = self.cfg.k_train
        return StepStats(float(flat[0]), flat[1:1 + k].long(), flat[1 + k:].long())

    # ---- evaluation ----

    def evaluate(self) -> dict:
        """Per-depth accuracy and the simulated acceptance length on held-out sequences (every element to K)."""
        k = self.cfg.k_train
        total = EvalStats(StepStats.zero(k), torch.zeros(k + 1, dtype=torch.long))
        self.drafter.eval()
        for seq in self.held_out[self.dist.rank::self.dist.world_size]:
            teacher = run_target(self.target, seq, self.aux_layer_ids, self.dist.device)
            with self.autocast:
                total = total + self.objective.evaluate(self.drafter, self.target, teacher)
        self.drafter.train()
        stats = self._reduce(total.stats)
        leading = self.dist.all_reduce(total.leading.to(self.dist.device)).cpu()
        result = EvalStats(stats, leading)
        charged = int(stats.total.sum())
        return {
            "loss": stats.loss / max(charged, 1), "acc": _round(stats.accuracy()),
            "cond_acc": _round(result.conditional_accuracy()),
            "sim_al": {str(j): round(result.acceptance_length(j), 4) for j in range(1, k + 1)},
            "rollouts": int(leading.sum()),
        }

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
            "drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
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
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.index = state["step"], state["epoch"], state["index"]
        if state.get("schedule_fitted"):  # a horizon fitted to an earlier run's time limit stays
            self.total_steps, self.schedule_fitted = state["total_steps"], True
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        logger.info("resumed from %s at step %d", found[-1], self.step)

    # ---- signals and logs ----

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dist.device.type == "cuda" else [])
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
        # Every process must stop after the same step, or the next all-reduce would hang.
        out_of_time = deadline is not None and time.monotonic() > deadline
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
            logger.info("step %d/%d loss %.4f acc %s lr %.2e %.0f positions/s", step, self.total_steps,
                        record["loss"], record["acc"][:4], record["lr"], record["positions_per_s"])
        elif kind == "eval":
            logger.info("eval at step %d: loss %.4f acc %s simulated AL@%d %.3f", step, record["loss"],
                        record["acc"][:4], self.cfg.k_train, record["sim_al"][str(self.cfg.k_train)])
        if self._tensorboard is not None:
            for key, value in _scalars(record):
                self._tensorboard.add_scalar(f"{kind}/{key}", value, step)


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


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def _round(values: list[float]) -> list[float]:
    return [round(v, 4) if v == v else None for v in values]


def _scalars(record: dict):
    for key, value in record.items():
        if isinstance(value, (int, float)) and key not in ("kind", "step"):
            yield key, value
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if v is not None:
                    yield f"{key}/{i + 1}", v
        elif isinstance(value, dict):
            for k, v in value.items():
                yield f"{key}/{k}", v


def config_record(cfg: TrainConfig) -> dict:
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v

    return {k: plain(v) for k, v in asdict(cfg).items()}


def build_trainer(cfg: TrainConfig, dist: DistContext) -> Trainer:
    """Loads the target, the data and a drafter (fresh or --init) and checks that they fit together."""
    target_config = ModelConfig.from_dir(cfg.target)
    if cfg.max_length > target_config.max_position_embeddings:
        raise ValueError(
            f"--max-length {cfg.max_length} is longer than the target supports "
            f"(max_position_embeddings {target_config.max_position_embeddings})"
        )
    if not cfg.resume and complete_checkpoints(cfg.out / CHECKPOINTS):
        raise FileExistsError(f"{cfg.out} already holds checkpoints; pass --resume to continue or choose another --out")
    tokenizer = load_tokenizer(cfg.target)
    documents = [doc for data_dir in cfg.data
                 for doc in read_documents(data_dir, tokenizer, target_config.vocab_size)]
    train_docs, held_docs = split_documents(documents, cfg.eval_fraction, cfg.max_eval_documents, cfg.seed)
    logger.info("%d training documents, %d held out", len(train_docs), len(held_docs))
    target = load_model(cfg.target, "bfloat16" if dist.device.type == "cuda" else "float32", dist.device)
    drafter = _make_drafter(cfg, target, tokenizer, train_docs).to(dist.device)
    if dist.is_main:
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / "train_config.json").write_text(json.dumps(config_record(cfg), indent=1) + "\n")
    held_out = pack(held_docs, range(len(held_docs)), cfg.max_length)
    return Trainer(cfg, target, drafter, TrainingData(train_docs, cfg.max_length, cfg.seed), held_out, dist)


def _make_drafter(cfg: TrainConfig, target: LlamaModel, tokenizer: Tokenizer, train_docs: list[Document]
                  ) -> Drafter:
    if cfg.init is not None:
        drafter = load_drafter(cfg.init, target.config, dtype="float32", target=target)
        if drafter.config.method != cfg.method:
            raise ValueError(f"--init {cfg.init} is a {drafter.config.method} head but --method is {cfg.method}")
    else:
        corpus = [d.token_ids[d.loss_mask].tolist() for d in train_docs] if cfg.draft_vocab_size else None
        drafter = Drafter.for_target(
            TargetParts.from_dir(cfg.target, tokenizer), cfg.method, cfg.layers,
            draft_vocab=cfg.draft_vocab_size, vocab_corpus=corpus, aux_layer_ids=cfg.aux_layer_ids,
            num_speculative_tokens=min(cfg.k_train, DEFAULT_NUM_SPECULATIVE_TOKENS[cfg.method]), seed=cfg.seed,
        )
    return drafter.float().requires_grad_(True).train()
