"""TrainConfig: everything `peagle train` decides, validated up front."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peagle.drafters.config import DEFAULT_NUM_LAYERS, METHODS

FAULTS = "faults"  # under --out: the steps in flight when the device faulted, and CUDA's core dump of the fault
GPU_CORE = "gpu-core"  # FAULTS/gpu-core.PID: CUDA's lightweight core dump of a device exception in process PID


def read_core_command(core: Path | str) -> str:
    """The command that names the faulting kernel from a GPU core dump, and where it stopped."""
    return f'cuda-gdb -batch -ex "target cudacore {core}" -ex "info cuda kernels" -ex bt'

OPTIMIZERS = ("adamw", "muon")  # --optimizer (optimizers.py)

SCHEDULES = ("linear", "cosine")
# The draft head's vocabulary when none is asked for (speculators' and SpecForge's 32K): it served more than the
# target's whole vocabulary with the same data and time (docs/DECISIONS.md).
DEFAULT_DRAFT_VOCAB = 32768
TIME_LIMITED_WARMUP = 30  # default warmup steps under --time-limit (the steps over which the rate is measured)
# Peak learning rate per method when --lr is not given: P-EAGLE's 1e-3 beat 6e-4 side by side on the same data and
# time; EAGLE-3 keeps the public recipes' 6e-4 (docs/DECISIONS.md).
DEFAULT_LR = {"peagle": 1e-3, "eagle3": 6e-4}
# Optimizer per method when --optimizer is not given: Muon for both, which served more than AdamW for each head in
# the one-session recipe (docs/DECISIONS.md). A dict per method, so that the two can part again.
DEFAULT_OPTIMIZER = {"peagle": "muon", "eagle3": "muon"}
# Depth trained per method when --k-train is not given. P-EAGLE drafts K in one pass and serves best at K=7-11, so it
# trains 8 deep (deeper costs steps and gains nothing at K=11). EAGLE-3 serves best at K=3, and trained 3 steps deep
# it serves more at K=3 and at K=7 than trained 7 deep, in the same time (docs/DECISIONS.md).
DEFAULT_K_TRAIN = {"peagle": 8, "eagle3": 3}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """A training run. The recipe defaults (lr 6e-4 cosine, frozen lm_head, a 32K draft vocabulary, COD 0.7 / 0.2,
    depth decay 0.8, feature noise 0.05) are the public recipes' choices (speculators, SpecForge), which beat the
    earlier defaults (lr 1e-3, trained full-vocabulary head, COD 0.8, no decay, no noise) on every held-out and
    served acceptance number for P-EAGLE with the same data and time; P-EAGLE's peak learning rate alone is 1e-3
    (DEFAULT_LR), and the optimizer is Muon for both heads (DEFAULT_OPTIMIZER). The evidence: docs/DECISIONS.md."""

    target: Path
    data: Path | tuple[Path, ...]  # one or more data directories; kept as a tuple
    out: Path
    method: str
    num_layers: int | None = None  # None: 4 for peagle, 1 for eagle3
    k_train: int | None = None  # None: DEFAULT_K_TRAIN[method]
    cod_r: float = 0.7
    cod_r_min: float = 0.2
    num_segments: int = 1
    max_length: int = 2048
    lr: float | None = None  # None: DEFAULT_LR[method]
    weight_decay: float = 0.0
    # "adamw", or "muon": Muon for the hidden weight matrices, AdamW for the rest (optimizers.py); None:
    # DEFAULT_OPTIMIZER[method]
    optimizer: str | None = None
    muon_lr: float | None = None  # Muon's peak learning rate (None: lr)
    warmup_steps: int | None = None  # None: 2% of the steps
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 1  # packed sequences per micro-batch per process
    grad_accum: int = 1
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    save_every: int = 1000
    eval_every: int = 500
    keep_checkpoints: int = 2
    eval_fraction: float = 0.01
    max_eval_documents: int = 64
    # directories evaluated apart and never trained on (their walk is the eval row's `eval_data`)
    eval_data: tuple[Path, ...] = ()
    max_eval_data_documents: int = 256  # documents read from each --eval-data directory at most
    # the held-out walk covers the first N tokens of each response (the benchmarks' max_tokens); 0: whole responses
    walk_max_tokens: int = 256
    loss_chunk: int = 4096
    seed: int = 0
    resume: bool = False
    init: Path | None = None
    draft_vocab_size: int | None = None  # None: DEFAULT_DRAFT_VOCAB, capped at the target's; 0: the whole vocabulary
    aux_layer_ids: tuple[int, int, int] | None = None
    feature_cache: Path | None = None
    time_limit_minutes: float | None = None  # finish (evaluate, save final/) once this much wall time has passed
    profile_steps: int = 0  # profile this many steps (after the first PROFILE_FROM) into out/profile.txt
    log_every: int = 10  # steps whose statistics are read from the device at once (one wait per interval)
    load_format: str = "auto"  # "dummy": a random target from config.json alone (throughput at a real shape only)
    prefetch_steps: int = 3  # steps planned ahead by a background thread; 0: each step planned in the training loop
    depth_decay: float = 0.8  # loss weight decay ** depth per element (SpecForge's 0.8)
    freeze_lm_head: bool = True  # keep the draft head at its initial rows (the target's), as speculators does
    freeze_embeddings: bool = False  # keep embed_tokens at the target's rows but P-EAGLE's MASK row (SpecForge's)
    feature_noise: float = 0.05  # std of Gaussian noise on the target features in training (speculators' 0.05)
    compile_elementwise: bool = False  # the drafter's norms, RoPE and SiLU compiled for training (compiled_ops.py)
    pad_target_pass: bool = False  # the target's pass over each micro-batch padded to batch size x --max-length
    # Row counts of a step's matrices padded up to multiples of this (plan.pad_shapes; the target's pass too, unless
    # --pad-target-pass or --feature-cache): a few shapes repeat instead of new ones each step. 0: off.
    shape_multiple: int = 0

    def __post_init__(self):
        dirs = (self.data,) if isinstance(self.data, (str, Path)) else tuple(self.data)
        if not dirs:
            raise ValueError("--data needs at least one data directory")
        object.__setattr__(self, "data", tuple(Path(d) for d in dirs))
        evaluation = (self.eval_data,) if isinstance(self.eval_data, (str, Path)) else tuple(self.eval_data)
        object.__setattr__(self, "eval_data", tuple(Path(d) for d in evaluation))
        both = {d.resolve() for d in self.data} & {d.resolve() for d in self.eval_data}
        if both:
            raise ValueError(f"{', '.join(sorted(map(str, both)))} given as both --data and --eval-data: a directory "
                             "is trained on or evaluated apart, not both")
        if self.max_eval_data_documents < 1:
            raise ValueError(f"--max-eval-data-documents must be at least 1, got {self.max_eval_data_documents}")
        if not 0.0 <= self.feature_noise < float("inf"):
            raise ValueError(f"--feature-noise must be a non-negative standard deviation, got {self.feature_noise}")
        if self.freeze_embeddings and self.weight_decay:
            raise ValueError(f"--freeze-embeddings with --weight-decay {self.weight_decay:g}: weight decay would move "
                             "the frozen rows; use one of them")
        if self.profile_steps < 0:
            raise ValueError(f"--profile-steps must be non-negative, got {self.profile_steps}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.load_format == "dummy" and self.feature_cache is not None:
            raise ValueError("--feature-cache with --load-format dummy would store a random target's features")
        if self.prefetch_steps < 0:
            raise ValueError(f"--prefetch-steps must be non-negative, got {self.prefetch_steps}")
        if self.time_limit_minutes is not None and self.time_limit_minutes <= 0:
            raise ValueError(f"--time-limit must be positive (minutes), got {self.time_limit_minutes}")
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.optimizer is None:
            object.__setattr__(self, "optimizer", DEFAULT_OPTIMIZER[self.method])
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.muon_lr is not None and (self.optimizer != "muon" or not self.muon_lr > 0):
            raise ValueError(f"--muon-lr {self.muon_lr}: a positive learning rate, with --optimizer muon only")
        if self.k_train is None:
            object.__setattr__(self, "k_train", DEFAULT_K_TRAIN[self.method])
        if self.k_train < 1:
            raise ValueError(f"--k-train must be at least 1 (tokens drafted per round), got {self.k_train}")
        if not 0.0 < self.cod_r <= 1.0:
            raise ValueError(f"--cod-r must be in (0, 1], got {self.cod_r}")
        if not 0.0 <= self.cod_r_min <= 1.0:
            raise ValueError(f"--cod-r-min must be in [0, 1], got {self.cod_r_min}")
        if self.num_segments < 1:
            raise ValueError(f"--num-segments must be at least 1, got {self.num_segments}")
        if self.num_segments > 1 and self.method != "peagle":
            raise ValueError("--num-segments (the sequence partition) applies to --method peagle only")
        if self.max_length < 3:
            raise ValueError(f"--max-length must be at least 3 tokens, got {self.max_length}")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of --steps and --epochs")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"--epochs must be positive, got {self.epochs}")
        if not 0.0 < self.depth_decay <= 1.0:
            raise ValueError(f"--depth-decay must be in (0, 1], got {self.depth_decay}")
        for name in ("batch_size", "grad_accum", "save_every", "eval_every", "keep_checkpoints", "loss_chunk",
                     "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.pad_target_pass and self.feature_cache is not None:
            raise ValueError("--pad-target-pass pads the target's pass, which --feature-cache replaces by reading "
                             "stored outputs: give one of them")
        if self.shape_multiple < 0 or self.shape_multiple % 128:
            raise ValueError(f"--shape-multiple must be a multiple of 128 (the attention's tile; 0: off), got "
                             f"{self.shape_multiple}")
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.method])
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be non-negative, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.walk_max_tokens < 0:
            raise ValueError(f"--walk-max-tokens must be >= 0 (0: whole responses), got {self.walk_max_tokens}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError(f"--draft-vocab-size must be positive (or 0: the whole vocabulary), got "
                             f"{self.draft_vocab_size}")
        if self.init is not None and self.draft_vocab_size is not None:
            raise ValueError("--draft-vocab-size builds a new head's vocabulary; --init brings its own")

    @property
    def layers(self) -> int:
        return self.num_layers or DEFAULT_NUM_LAYERS[self.method]

    def warmup(self, total_steps: int) -> int:
        """--warmup-steps, else 2% of the steps; under --time-limit at most TIME_LIMITED_WARMUP steps, because the
        schedule's end is then fitted to the time and --steps is only an upper bound (2% of it could be the whole
        run, spent below the peak learning rate)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        default = max(1, total_steps // 50)
        return min(default, TIME_LIMITED_WARMUP) if self.time_limit_minutes is not None else default
