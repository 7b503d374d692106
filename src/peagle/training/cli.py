"""`peagle regenerate`, `peagle synthesize`, `peagle train` (one process, or one per GPU under torchrun),
`peagle train-replay` and `peagle train-report`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from peagle.drafters.config import METHODS
from peagle.training.config import FAULTS, GPU_CORE, OPTIMIZERS, SCHEDULES, TrainConfig


def register(subparsers) -> None:
    regen = subparsers.add_parser(
        "regenerate", help="answer training prompts with the target (drafter training data)",
        description="Render each prompt with the target's chat template (--completions: as raw text, for a base "
                    "model), let the target answer (continue) it greedily through "
                    "the engine, and write prompt + response shards for `peagle train`. Resumable: run the same "
                    "command again to continue. Prompt files that overlap the built-in benchmark sets are refused.",
    )
    regen.add_argument("--model", type=Path, required=True, help="target checkpoint directory")
    regen.add_argument("--prompts", type=Path, required=True,
                       help='JSON Lines ({"messages": [...]} or {"prompt": ...}; .gz read as gzip) or ShareGPT JSON '
                            "(its train split)")
    regen.add_argument("--out", type=Path, required=True, help="output data directory")
    regen.add_argument("--max-tokens", type=int, default=1024, help="response length limit per turn (default 1024)")
    regen.add_argument("--batch-size", type=int, default=256, help="prompts per shard (default 256)")
    regen.add_argument("--max-num-seqs", type=int, default=512,
                       help="requests the engine runs at once; the batch is refilled in waves (default 512)")
    regen.add_argument("--limit", type=int,
                       help="use only the first N prompts (records: conversations, with --multi-turn or --completions)")
    regen.add_argument("--multi-turn", action="store_true",
                       help="answer every user turn in order, each after the target's own earlier answers; one "
                            "document per conversation, loss on the target's tokens only")
    regen.add_argument("--max-turns", type=int,
                       help="with --multi-turn: answer at most N turns per conversation; with --completions: at "
                            "most N user turns of each record become prompts")
    regen.add_argument("--completions", action="store_true",
                       help="a base model (no chat template, e.g. Gemma 3 270M): continue each user turn of a record "
                            "as raw text, a prompt of its own (with the tokenizer's BOS), instead of answering a chat; "
                            "the loss on the continuation. Not with --multi-turn")
    regen.add_argument("--exclude-overlap", action="store_true",
                       help="drop prompts that overlap a benchmark set instead of refusing the file")
    regen.add_argument("--eval-set", action="store_true",
                       help="write an evaluation set for `peagle train --eval-data`, never training data: prompts "
                            "of ShareGPT's held-out split are allowed (benchmark prompts still are not) and the "
                            "manifest is marked evaluation_only, which `peagle train --data` refuses")
    regen.add_argument("--part", type=_part, metavar="I/N",
                       help="answer only the I-th (0-based) of N equal parts of the prompts, so that N processes "
                            "share one GPU (each its own --out and --num-kv-blocks)")
    regen.add_argument("--num-kv-blocks", type=int,
                       help="KV-cache blocks of 16 tokens (default: sized from free GPU memory)")
    regen.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    regen.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                       help="the engine schedules each step while the GPU runs the one before (the same greedy "
                            "output; on by default, as in `peagle serve`)")
    regen.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="steps that prefill (up to 2048 tokens and 16 requests) replay CUDA graphs, as in "
                            "`peagle serve` (the same output; on by default)")
    regen.add_argument("--speculative-config", type=_json_object,
                       help='speculate while generating (same output, faster), e.g. '
                            '\'{"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 7}\'')
    regen.add_argument("--dtype", default="bfloat16", help="target dtype (default bfloat16)")
    regen.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    regen.add_argument("--max-model-len", type=int, help="prompt + response limit (default: the model's)")
    regen.set_defaults(func=_regenerate)

    synth = subparsers.add_parser(
        "synthesize", help="let the target write training prompts itself (Magpie-style)",
        description="Sample user turns from the target's chat template's user prefix (after its system turn, if it "
                    "has one), then deduplicate and filter them (length, language, repetition, benchmark overlap). "
                    "Writes JSON Lines of {\"messages\": [user turn]} for `peagle regenerate`.",
    )
    synth.add_argument("--model", type=Path, required=True, help="target checkpoint directory")
    synth.add_argument("--out", type=Path, required=True, help="JSON Lines file to write (.gz: compressed)")
    synth.add_argument("--count", type=int, required=True, help="prompts to write")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--max-tokens", type=int, default=256, help="longest user turn in tokens (default 256)")
    synth.add_argument("--temperature", type=float, default=1.0)
    synth.add_argument("--top-p", type=float, default=0.99)
    synth.add_argument("--min-chars", type=int, default=16, help="shortest prompt kept (default 16)")
    synth.add_argument("--max-chars", type=int, default=2000, help="longest prompt kept (default 2000)")
    synth.add_argument("--system", help="system turn to write the prefix with (default: the template's own)")
    synth.add_argument("--max-num-seqs", type=int, default=1024, help="requests the engine runs at once")
    synth.add_argument("--dtype", default="bfloat16", help="target dtype (default bfloat16)")
    synth.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    synth.set_defaults(func=_synthesize)

    train = subparsers.add_parser(
        "train", help="train a P-EAGLE or EAGLE-3 drafter",
        description="Train a drafter head for --target on data from `peagle regenerate`. Several GPUs: "
                    "torchrun --nproc-per-node N -m peagle train ... (same arguments). After a CUDA fault, "
                    "<--out>/faults/ holds the steps in flight (`peagle train-replay`) and CUDA's lightweight core "
                    "dump, gpu-core.PID, which names the faulting kernel (set CUDA_ENABLE_COREDUMP_ON_EXCEPTION=0 to "
                    "turn it off).",
    )
    train.add_argument("--target", type=Path, required=True, help="target checkpoint directory")
    train.add_argument("--data", type=Path, nargs="+", required=True, metavar="DIR",
                       help="data directories written by `peagle regenerate` (several are mixed)")
    train.add_argument("--method", choices=METHODS, required=True)
    train.add_argument("--out", type=Path, required=True, help="output directory (checkpoints, logs, final/)")
    train.add_argument("--num-layers", type=int, help="drafter layers (default 4 for peagle, 1 for eagle3)")
    train.add_argument("--k-train", type=int,
                       help="drafting depth trained (default 8 for peagle, 3 for eagle3: each method's best; see "
                            "docs/DECISIONS.md)")
    train.add_argument("--cod-r", type=float, default=0.7, help="COD keep ratio per depth (default 0.7)")
    train.add_argument("--cod-r-min", type=float, default=0.2, help="COD floor (default 0.2)")
    train.add_argument("--num-segments", type=int, default=1,
                       help="sequence partition segments: more segments, less memory (peagle; default 1)")
    train.add_argument("--max-length", type=int, default=2048, help="tokens per packed sequence (default 2048)")
    train.add_argument("--lr", type=float,
                       help="peak learning rate (default 1e-3 for --method peagle, 6e-4 for eagle3)")
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--optimizer", choices=OPTIMIZERS,
                       help="adamw: AdamW for every trained parameter; muon: Muon for the drafter's hidden weight "
                            "matrices (speculators' default), AdamW for embeddings, norms and mask_hidden (default: "
                            "muon for both methods)")
    train.add_argument("--muon-lr", type=float, help="Muon's peak learning rate (default: --lr; Muon's update is "
                                                     "scaled to AdamW's RMS)")
    train.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 2%% of the steps; with --time-limit at most 30)")
    length = train.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="optimizer steps")
    length.add_argument("--epochs", type=float, help="passes over the training data")
    train.add_argument("--batch-size", type=int, default=1, help="packed sequences per micro-batch per process")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--schedule", choices=SCHEDULES, default="cosine", help="decay after warmup (default cosine)")
    train.add_argument("--max-grad-norm", type=float, default=1.0)
    train.add_argument("--save-every", type=int, default=1000, help="checkpoint every N steps")
    train.add_argument("--eval-every", type=int, default=500, help="held-out evaluation every N steps")
    train.add_argument("--keep-checkpoints", type=int, default=2, help="most recent checkpoints kept")
    train.add_argument("--eval-fraction", type=float, default=0.01, help="documents held out (default 1%%)")
    train.add_argument("--max-eval-documents", type=int, default=64,
                       help="held-out documents at most, shared out between the --data sources (default 64)")
    train.add_argument("--eval-data", type=Path, nargs="+", default=(), metavar="DIR",
                       help="data directories evaluated beside the held-out documents and never trained on (e.g. "
                            "`peagle regenerate --eval-set` of ShareGPT's held-out split: prompts unlike the "
                            "training sources', as the benchmarks' are); their walk is logged as eval_data. A "
                            "document that is also a training document is left out; a directory with more than a "
                            "quarter of them is refused")
    train.add_argument("--max-eval-data-documents", type=int, default=256, metavar="N",
                       help="documents scored from each --eval-data directory at most (default 256)")
    train.add_argument("--walk-max-tokens", type=int, default=256, metavar="N",
                       help="the held-out walk (walk_al) covers the first N tokens of each response, as serving with "
                            "max_tokens N does: a small target's greedy answers end in loops that inflate it past "
                            "the benchmarks' 256 tokens (default 256; 0: whole responses)")
    train.add_argument("--loss-chunk", type=int, default=4096, help="positions per loss chunk (memory)")
    train.add_argument("--aux-layer-ids", type=int, nargs=3, metavar="ID",
                       help="target layers feeding the drafter (default 2, L/2, L-3)")
    train.add_argument("--feature-cache", type=Path, metavar="DIR",
                       help="keep the target's outputs per document on disk and reuse them in later epochs "
                            "(8 x target hidden size bytes per token for bf16 targets)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    train.add_argument("--time-limit", type=float, metavar="MINUTES",
                       help="stop after this much wall time as if the steps had run out: evaluate and save final/. "
                            "The schedule is fitted to it: after 30 steps the step rate is measured and, if "
                            "--steps/--epochs would not fit, the learning rate decays to zero when time runs out")
    train.add_argument("--profile-steps", type=int, default=0, metavar="N",
                       help="profile N steps after the first 5 (compilation) with torch.profiler: a table of the "
                            "most expensive operators in OUT/profile.txt")
    train.add_argument("--log-every", type=int, default=10, metavar="N",
                       help="read the statistics from the device every N steps (the step itself never waits for "
                            "the GPU; default 10)")
    train.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                       help="dummy: a random target built from --target's config.json alone (vLLM's name), to measure "
                            "training throughput and memory at a real model's shape without its weights; the head "
                            "it trains is meaningless (default auto: the checkpoint's weights)")
    train.add_argument("--prefetch-steps", type=int, default=3, metavar="N",
                       help="plan up to N steps ahead (sampling, layouts, pinned copies) in a background thread "
                            "while the GPU runs the current one (default 3; 0: plan each step in the training loop, "
                            "no second thread; the steps are the same either way)")
    train.add_argument("--depth-decay", type=float, default=0.8, metavar="GAMMA",
                       help="weight the loss of a depth-d element by GAMMA**d (default 0.8; 1: all depths alike)")
    train.add_argument("--freeze-lm-head", action=argparse.BooleanOptionalAction, default=True,
                       help="keep the draft head's output rows as initialised from the target's (default; "
                            "--no-freeze-lm-head trains them)")
    train.add_argument("--freeze-embeddings", action=argparse.BooleanOptionalAction, default=False,
                       help="keep the token embedding at the target's rows, as SpecForge's recipes do (P-EAGLE's MASK "
                            "row, its learned mask-token embedding, still trains); default: the whole embedding trains. "
                            "Not with --weight-decay, which would move the frozen rows")
    train.add_argument("--feature-noise", type=float, default=0.05, metavar="STD",
                       help="add Gaussian noise of this standard deviation to the target features the drafter reads "
                            "in training (not in evaluation; default 0.05; 0: none)")
    train.add_argument("--compile-elementwise", action="store_true",
                       help="compile the drafter's element-wise steps (RMSNorm, RoPE, SiLU-and-mul) for training; "
                            "each is checked against its reference first and kept as the reference if it differs "
                            "or fails (off by default until timed on the GPU)")
    train.add_argument("--pad-target-pass", action="store_true",
                       help="pad the target's pass over each step's packed sequence to batch size x --max-length "
                            "tokens, so its matrix shapes repeat from step to step (a few percent more target "
                            "work; off by default until timed on the GPU: scripts/device/mm_host_cost.py)")
    train.add_argument("--shape-multiple", type=int, default=0, metavar="ROWS",
                       help="pad the row counts of each step's matrices (the target's pass, the teacher table, "
                            "the drafter's rows, the charged elements) up to multiples of ROWS (a multiple of "
                            "128, e.g. 1024) with rows that carry no loss, so that a few shapes repeat from step to "
                            "step: a GEMM of a shape not seen before costs ~100 us of host time to choose its "
                            "kernel, a repeated one ~15 us (see docs/DECISIONS.md). For a trainer the host holds "
                            "back; 0 (default): off")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--init", type=Path, metavar="DRAFTER_DIR", help="start from an existing head")
    train.add_argument("--draft-vocab-size", type=int,
                       help="restrict the head to the N most frequent response tokens (default 32768, or the "
                            "target's whole vocabulary if smaller; 0: the whole vocabulary)")
    train.set_defaults(func=_train)

    replay = subparsers.add_parser(
        "train-replay", help="run the steps a trainer recorded at a device fault, alone, to find the faulting one",
        description="After a CUDA error (e.g. 'unspecified launch failure') `peagle train` writes the steps the "
                    "device had not finished to <--out>/faults/step-N/ (fault.json: the error, each step's data "
                    "position and shapes; plans.pt: the steps' plans). This runs those steps again, one at a time, "
                    "from the run's newest checkpoint (else its starting drafter), with CUDA_LAUNCH_BLOCKING=1 so "
                    "that an error names the kernel that raised it, and says which step faulted. Exit status 1 if one "
                    "did. Wrap it in `compute-sanitizer --tool memcheck` (with PYTORCH_NO_CUDA_MEMORY_CACHING=1) to "
                    "see the faulting access.",
        epilog="example:\n  peagle train-replay runs/peagle/faults/step-00006251",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("fault_dir", type=Path, metavar="FAULT_DIR", help="a directory under <--out>/faults/")
    replay.add_argument("--history", type=int, default=0, metavar="N",
                        help="first run the run's first N steps from the start of its data, so that the compiled "
                             "kernels meet the shapes in the order the run met them (a fault that needs a kernel "
                             "compiled for an earlier shape); the drafter and optimizer state are restored after "
                             "them (default 0)")
    replay.set_defaults(func=_train_replay)

    report = subparsers.add_parser(
        "train-report", help="compare training runs from their logs: a table and the held-out walk over time",
        description="Read the train_log.jsonl of one or more `peagle train` runs and print, per run, its last "
                    "evaluation: steps, training minutes, median tokens/s, held-out accuracy by depth and the "
                    "held-out walk's acceptance length at one K (on the training sources' held-out split and on "
                    "--eval-data). --plot draws the walk over training time, the curves a recipe A/B is read from.",
        epilog="example:\n  peagle train-report base=runs/base lr2e-3=runs/lr2e-3/train_log.jsonl --k 7 "
               "--plot ab.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("logs", nargs="+", metavar="[LABEL=]LOG",
                        help="a train_log.jsonl (.gz read as gzip) or a `peagle train --out` directory; LABEL "
                             "names it in the table (default: the directory's or the file's name)")
    report.add_argument("--k", type=int, help="the walk's draft length (default 7 if the logs walked it, else "
                                              "their deepest common K)")
    report.add_argument("--plot", type=Path, metavar="PNG", help="also draw the walk over training time here")
    report.add_argument("--title", help="the plot's title")
    report.add_argument("--simulated", action="store_true",
                        help="also draw the simulated AL (every anchor averaged: it overstates serving)")
    report.set_defaults(func=_train_report)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _part(text: str) -> tuple[int, int]:
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def _regenerate(args: argparse.Namespace) -> int:
    from peagle.training.regenerate import regenerate

    manifest = regenerate(
        args.model, args.prompts, args.out, max_tokens=args.max_tokens, batch_size=args.batch_size,
        limit=args.limit, speculative_config=args.speculative_config, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, multi_turn=args.multi_turn,
        max_turns=args.max_turns, exclude_overlap=args.exclude_overlap, part=args.part,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=args.async_scheduling, prefill_cuda_graphs=args.prefill_cuda_graphs, eval_set=args.eval_set,
        completions=args.completions,
    )
    docs = sum(s["num_documents"] for s in manifest.shards)
    tokens = sum(s["num_tokens"] for s in manifest.shards)
    print(f"{args.out}: {docs} documents, {tokens} tokens from {manifest.prompts_done} prompts")
    return 0


def _synthesize(args: argparse.Namespace) -> int:
    from peagle.training.synthesize import SynthesisConfig, synthesize

    cfg = SynthesisConfig(count=args.count, seed=args.seed, max_tokens=args.max_tokens,
                          temperature=args.temperature, top_p=args.top_p, min_chars=args.min_chars,
                          max_chars=args.max_chars, system=args.system, max_num_seqs=args.max_num_seqs)
    stats = synthesize(args.model, args.out, cfg, dtype=args.dtype, device=args.device)
    print(f"{args.out}: {stats.kept} prompts from {stats.sampled} samples ({stats.summary()})")
    return 0


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        target=args.target, data=args.data, out=args.out, method=args.method, num_layers=args.num_layers,
        k_train=args.k_train, cod_r=args.cod_r, cod_r_min=args.cod_r_min, num_segments=args.num_segments,
        max_length=args.max_length, lr=args.lr, weight_decay=args.weight_decay, optimizer=args.optimizer,
        muon_lr=args.muon_lr, warmup_steps=args.warmup_steps,
        steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, grad_accum=args.grad_accum,
        schedule=args.schedule, max_grad_norm=args.max_grad_norm, save_every=args.save_every,
        eval_every=args.eval_every, keep_checkpoints=args.keep_checkpoints, eval_fraction=args.eval_fraction,
        max_eval_documents=args.max_eval_documents, eval_data=args.eval_data,
        max_eval_data_documents=args.max_eval_data_documents, walk_max_tokens=args.walk_max_tokens,
        loss_chunk=args.loss_chunk, seed=args.seed,
        resume=args.resume, init=args.init, draft_vocab_size=args.draft_vocab_size,
        aux_layer_ids=tuple(args.aux_layer_ids) if args.aux_layer_ids else None, feature_cache=args.feature_cache,
        time_limit_minutes=args.time_limit, profile_steps=args.profile_steps, log_every=args.log_every, prefetch_steps=args.prefetch_steps, load_format=args.load_format,
        depth_decay=args.depth_decay, freeze_lm_head=args.freeze_lm_head,
        freeze_embeddings=args.freeze_embeddings,
        feature_noise=args.feature_noise, compile_elementwise=args.compile_elementwise,
        pad_target_pass=args.pad_target_pass, shape_multiple=args.shape_multiple,
    )


def _train_report(args: argparse.Namespace) -> int:
    from peagle.training.report import default_k, load_run, plot, table, walks

    if args.k is not None and args.k < 1:
        raise ValueError(f"--k must be at least 1, got {args.k}")
    runs = [load_run(spec) for spec in args.logs]
    k = default_k(runs) if args.k is None else args.k
    missing = [r.label for r in runs if k not in walks(r.last_eval)]
    if missing:
        raise ValueError(f"the last evaluation of {', '.join(missing)} has no walk at K={k} (the trainer walks "
                         "K = 1..--k-train)")
    print(table(runs, k))
    if args.plot:
        print(f"plot: {plot(runs, k, args.plot, args.title, args.simulated)}")
    return 0


def _train_replay(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")  # read when CUDA starts: an error then names its kernel
    from peagle.training.distributed import init_distributed, shutdown_distributed
    from peagle.training.trainer import replay_fault

    dist = init_distributed()
    try:
        rows = replay_fault(args.fault_dir, dist, args.history)
    finally:
        shutdown_distributed()
    for row in rows:
        state = "ran clean" if row["error"] is None else f"FAULTED: {row['error']}"
        what = "history step" if row.get("history") else "step"
        print(f"{what} {row['step']} (epoch {row['epoch']}, sequence {row['index']}): {state}")
    faulted = any(row["error"] is not None for row in rows)
    print(json.dumps({"steps": rows, "faulted": faulted}))
    return 1 if faulted else 0


GPU_CORE_ENV = "CUDA_ENABLE_COREDUMP_ON_EXCEPTION"


def arm_gpu_core_dumps(out: Path, environ=os.environ) -> bool:
    """Asks CUDA, before it starts in this process, for a lightweight GPU core dump on a device exception (the
    faulting kernel, its warps and program counters; no memory contents, no host core, no abort) in
    <out>/faults/gpu-core.PID, read with `cuda-gdb -ex "target cudacore FILE"`. A fault then names its kernel
    without a rerun. Left alone when the caller set CUDA_ENABLE_COREDUMP_ON_EXCEPTION itself (0 turns it off);
    returns whether it armed them."""
    if GPU_CORE_ENV in environ:
        return False
    faults = Path(out) / FAULTS
    faults.mkdir(parents=True, exist_ok=True)
    environ.update({GPU_CORE_ENV: "1", "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION": "0",
                    "CUDA_ENABLE_LIGHTWEIGHT_COREDUMP": "1",
                    "CUDA_COREDUMP_FILE": str(faults.resolve() / f"{GPU_CORE}.%p")})
    return True


def _train(args: argparse.Namespace) -> int:
    import torch

    from peagle.training.distributed import init_distributed, shutdown_distributed
    from peagle.training.trainer import build_trainer

    cfg = train_config(args)  # validate before touching devices
    arm_gpu_core_dumps(cfg.out)
    dist = init_distributed()
    try:
        return build_trainer(cfg, dist).train()
    except torch.cuda.OutOfMemoryError:
        raise ValueError(
            f"out of GPU memory at --max-length {cfg.max_length} with --num-segments {cfg.num_segments}: use a "
            f"larger --num-segments (e.g. {cfg.num_segments * 2}), a smaller --loss-chunk or --batch-size, or a "
            "shorter --max-length"
        ) from None
    finally:
        shutdown_distributed()
