"""`peagle serve`: an OpenAI-compatible HTTP server over the engine."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from peagle.server import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)

SPEC_ENV_VARS = ("PEAGLE_SPECULATIVE_CONFIG", "SM_VLLM_SPECULATIVE_CONFIG")
STATS_INTERVAL_S = 10.0  # vLLM's default interval between stats lines


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL_DIR at /v1/chat/completions, /v1/completions, /v1/responses and /v1/models "
                    "(streaming or not), with /health and Prometheus /metrics. Speculative decoding is configured as "
                    "vLLM takes it: "
                    "--speculative-config, else the PEAGLE_SPECULATIVE_CONFIG or SM_VLLM_SPECULATIVE_CONFIG "
                    "environment variable.",
    )
    p.add_argument("model", metavar="MODEL_DIR", nargs="?",
                   help="target checkpoint directory (Hugging Face layout); or `model` in --config")
    p.add_argument("--config", metavar="YAML",
                   help="options from a YAML file, as vLLM's --config: keys are option names without the dashes "
                        "(max-model-len or max_model_len: 4096; true / false for switches; lists and objects for the "
                        "JSON options); the command line wins over the file")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding as JSON, e.g. \'{"method": "eagle3", "model": "DRAFTER_DIR", '
                        '"num_speculative_tokens": 7, "parallel_drafting": true}\' (P-EAGLE); without it, the '
                        f"{' or '.join(SPEC_ENV_VARS)} environment variable, else no speculation")
    p.add_argument("--draft-confidence-cutoff", type=float, metavar="C",
                   help="verify only the drafts whose confidence (the drafter's probability of the chain up to "
                        "them) reaches C, in [0, 1], at every load (0: every draft); by default the adaptive "
                        "policy's cutoffs per load (the head's adaptive.json), else every draft")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=_port, metavar="PORT", default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PEAGLE_API_KEY, else open)")
    p.add_argument("--served-model-name", metavar="NAME", nargs="+",
                   help="model name clients send and /v1/models lists (default: MODEL_DIR); several names: requests "
                        "may send any, responses carry the first (as vLLM)")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="longest prompt + output in tokens (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, metavar="N", default=64,
                   help="requests decoded together in one batch (default 64)")
    p.add_argument("--max-queue", type=int, metavar="N", default=DEFAULT_MAX_QUEUE,
                   help="requests accepted beyond --max-num-seqs to wait for a slot; more get 503 with Retry-After "
                        f"(default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION", default=0.9,
                   help="fraction of GPU memory the engine may use: weights, KV cache, activations (default 0.9)")
    p.add_argument("--num-kv-blocks", type=int, metavar="N",
                   help="KV-cache blocks (default: as many as memory allows)")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: bfloat16 on a GPU, float32 on the CPU), bfloat16, float16 or float32 "
                        "(aliases bf16, fp16, fp32)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill long prompts in chunks of what the running decodes leave of each step's token budget, "
                        "so they never stall the decodes for more than one step (vLLM's name; off by default)")
    p.add_argument("--block-size", type=int, choices=(8, 16, 32, 64), default=16,
                   help="tokens per KV-cache block (default 16)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="start prompts from the cached KV blocks of earlier prompts that began with the same tokens "
                        "(full blocks; the drafter's cache too); off by default, since benchmarks repeat prompts. /metrics then "
                        "counts prefix_cache_queries and prefix_cache_hits (tokens)")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help="tokens per step (default: max-model-len, or 2048 with --enable-chunked-prefill)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="prepare the next step on the host while the GPU runs the current one, steps that admit "
                        "new prompts included (vLLM's name; on by default: 1.14x at batch 1 and 1.38x at batch 64 "
                        "on an H200, 13-14%% more when requests finish apart, the same greedy output; "
                        "--no-async-scheduling schedules each step after the one before)")
    p.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay CUDA graphs for steps that prefill (whole prompts, chunks, prompts beside decodes) "
                        "of up to 2048 tokens and 16 requests, not only for decode steps; each shape is captured on "
                        "first use (on by default: TTFT 4.1 against 16.2 ms at concurrency 1 on an H200, the same "
                        "greedy output; --no-prefill-cuda-graphs runs those steps eagerly)")
    p.add_argument("--chat-template", metavar="TEMPLATE",
                   help="the chat template for /v1/chat/completions instead of the model's: a file's path, or the "
                        "Jinja template itself in one line (as vLLM takes it); checked at start-up")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for fields a request leaves out (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_tokens from max_new_tokens): auto (default, as vLLM) reads the "
                        "model's generation_config.json, vllm uses none, DIR reads DIR/generation_config.json")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat template sent in a request's chat_template field (refused by default, as "
                        "vLLM refuses it; templates run in a sandbox)")
    p.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"),
                   help="split a reasoning model's thinking (<think> ... </think>) from its answer in chat "
                        "responses: message.reasoning (and reasoning_content) beside content, streamed as reasoning "
                        "deltas; tool calls are parsed and structured output enforced after the thinking only; "
                        "requests may send include_reasoning: false. qwen3: no thinking when a request sends "
                        "chat_template_kwargs {\"enable_thinking\": false}; deepseek_r1: always thinking (vLLM's "
                        "names; default none: the thinking stays in content)")
    p.add_argument("--seed", type=int, metavar="N", default=0,
                   help="engine seed (default 0; requests may pass their own)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenize, detokenize and stop with this directory's tokenizer (default: MODEL_DIR's; "
                        "requests end at its EOS tokens and the model config's)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="auto: the checkpoint's weights; dummy: random weights from its config.json (for trying the "
                        "server without weights; a speculative config's model may then be 'dummy')")
    p.add_argument("--synthetic-acceptance", type=_rates, metavar="R1,R2,...",
                   help="BENCHMARKING ONLY, needs --load-format dummy and a speculative config: accept draft "
                        "position i with rate Ri (accepted at position i / rounds, as measured on a real model) "
                        "instead of asking the target, so the serving cost of a real head's acceptance is measured "
                        "on random weights; the outputs are meaningless")
    http = p.add_argument_group("HTTP (vLLM's names)")
    http.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                      help='CORS: origins browsers may call from, a JSON list (default ["*"])')
    http.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                      help='CORS: allowed methods, a JSON list (default ["*"])')
    http.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                      help='CORS: allowed headers, a JSON list (default ["*"])')
    http.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default off)")
    http.add_argument("--root-path", default="", metavar="PATH",
                      help="the path prefix a proxy serves the app under (FastAPI's root_path; default none)")
    http.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key (with --ssl-certfile)")
    http.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate (with --ssl-keyfile)")
    http.add_argument("--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug", "trace"),
                      help="uvicorn's log level (default: peagle's own, --log-level)")
    http.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    http.add_argument("--enable-request-id-headers", action="store_true",
                      help="answer every request with an X-Request-Id header (the request's own, else a new id); "
                           "a request's X-Request-Id or body request_id names its response id either way")
    vllm = p.add_argument_group("vLLM command lines (so that they run unchanged)")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                      help="1: peagle runs on one device (another value stops start-up)")
    vllm.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                      help="1: peagle runs on one device (another value stops start-up)")
    vllm.add_argument("--trust-remote-code", action="store_true",
                      help="accepted and needless: peagle runs no code from checkpoints (it implements the families "
                           "it serves itself), and a checkpoint of another architecture is refused either way")
    vllm.add_argument("--tool-call-parser", choices=("hermes",),
                      help="hermes, the one format peagle parses; start-up then checks that the chat template "
                           "renders tools in it (without this option, tool calling works for any template that does)")
    vllm.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="tool_choice 'auto' (on for any Hermes-format template either way; with this option "
                           "--tool-call-parser is required, as vLLM requires it)")
    vllm.add_argument("--enable-log-requests", action="store_true",
                      help="log each request at INFO as it arrives: its id, prompt, prompt tokens and sampling "
                           "parameters (vLLM's; off by default)")
    vllm.add_argument("--disable-log-requests", action="store_true",
                      help="requests are not logged: the default (vLLM's older switch)")
    vllm.add_argument("--max-log-len", type=int, metavar="N",
                      help="with --enable-log-requests, the characters of each prompt and the prompt token ids "
                           "logged (default: all)")
    vllm.add_argument("--kv-cache-dtype", choices=("auto",), default="auto",
                      help="auto: the KV cache holds the model's dtype (fp8 caches are not implemented)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="after a request's first tokens, send its tokens once N have gathered (and when it ends): "
                        "fewer, larger chunks, so that a busy server spends less time writing them (vLLM's name; "
                        "default 1: every engine step's tokens as they come)")
    procs = p.add_argument_group("processes (vLLM's arrangement)")
    procs.add_argument("--engine-thread", action="store_true",
                       help="run the engine in a thread of the API server instead of a process of its own (for "
                            "debugging: the server's Python and the engine's host loop then share one GIL)")
    procs.add_argument("--engine-process", action="store_true",
                       help="the engine in a process of its own: the default (accepted so that older command lines "
                            "run)")
    procs.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                       help="API server processes accepting on one socket, all talking to the one engine process, "
                            "for when one core cannot keep up with the HTTP and streaming work (vLLM's name; default "
                            "1). With N > 1 /metrics sums every server's counters, and the periodic stats lines are "
                            "off")
    procs.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM (or Ctrl-C), stop accepting and let the requests in flight finish for up to "
                            "this long, then cancel the rest and exit 0 (default 30)")
    procs.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                       help="larger request bodies answer 413 before they are parsed (default "
                            f"{DEFAULT_MAX_REQUEST_BYTES // (1 << 20)} MiB)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats lines (by default every 10 s while requests run, as vLLM: prompt and "
                        "generation throughput, running and waiting requests, KV-cache usage, and the acceptance of "
                        "the requests that finished: mean acceptance length, per-position acceptance rate)")
    p.set_defaults(func=_serve)
    return p


def expand_config(argv: list[str]) -> list[str]:
    """`peagle ... serve ... --config FILE` with FILE's options written out in front of the command line's (which
    then win: argparse keeps an option's last value), as vLLM's `serve --config` reads a YAML file. Unknown keys
    and values of the wrong shape are refused naming the key. Any other command line comes back as it is."""
    import json

    import yaml

    at = 0
    while at < len(argv) and argv[at].startswith("-"):  # the global options before the command
        at += 2 if argv[at] == "--log-level" else 1
    if at >= len(argv) or argv[at] != "serve":
        return argv
    at += 1
    rest, path, i = [], None, at
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if path is None:
        return argv
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config: cannot read {path!r} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path!r} is not valid YAML: {e}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path!r}: expected a mapping of option names to values")
    serve = register(argparse.ArgumentParser().add_subparsers())
    actions = {opt: a for a in serve._actions for opt in a.option_strings}
    model = loaded.pop("model", None)
    options = []
    for key, value in loaded.items():
        opt = "--" + str(key).replace("_", "-")
        action = actions.get(opt)
        if action is None or opt in ("--config", "--help"):
            raise ValueError(f"--config {path!r}: unknown option {key!r} (see peagle serve --help)")
        if action.nargs == 0:  # a switch: store_true, or BooleanOptionalAction (--x / --no-x)
            if not isinstance(value, bool):
                raise ValueError(f"--config {path!r}: {key} is a switch: give true or false, not {value!r}")
            if value:
                options.append(opt)
            elif isinstance(action, argparse.BooleanOptionalAction):
                options.append("--no-" + opt[2:])
        elif action.nargs in ("+", "*"):  # several values (--served-model-name a b)
            options += [opt, *map(str, value if isinstance(value, list) else [value])]
        elif isinstance(value, (list, dict)):
            options += [opt, json.dumps(value)]
        elif value is None or isinstance(value, bool):
            raise ValueError(f"--config {path!r}: {key} takes a value, not {value!r}")
        else:
            options += [opt, str(value)]
    # The command line's MODEL_DIR, if it has one, wins over the file's.
    has_model = _positional_given(actions, rest)
    head = [str(model)] if model is not None and not has_model else []
    return argv[:at] + head + options + rest


def _positional_given(actions: dict, args: list[str]) -> bool:
    """Whether `args` (serve's options) hold a positional argument: a word that is neither an option nor the value
    an option takes."""
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return i + 1 < len(args)
        if a.startswith("-") and a != "-":
            action = actions.get(a.split("=", 1)[0])
            i += 1
            if action is None or action.nargs == 0 or "=" in a:
                continue
            if action.nargs in ("+", "*"):  # argparse gives it every word up to the next option
                while i < len(args) and not args[i].startswith("-"):
                    i += 1
            else:
                i += 1
            continue
        return True
    return False


def _serve(args: argparse.Namespace) -> int:
    from peagle.engine.config import EngineConfig, SpeculativeConfig
    from peagle.engine.llm import check_max_model_len, resolve_dtype
    from peagle.engine.sampling_params import model_sampling_defaults
    from peagle.models.loader import load_tokenizer
    from peagle.models.config import ModelConfig
    from peagle.server.launcher import launch
    from peagle.server.reasoning import REASONING_PARSERS
    from peagle.models.tokenizer import load_chat_template

    if args.model is None:
        hint = ""
        if args.served_model_name and len(args.served_model_name) > 1:
            hint = (f" (--served-model-name took {args.served_model_name[-1]!r} as a name: give MODEL_DIR first, "
                    "or end the names with another option)")
        raise ValueError(f"MODEL_DIR is missing: give it on the command line or as `model` in --config{hint}")
    for option, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                          ("--pipeline-parallel-size", args.pipeline_parallel_size)):
        if value != 1:
            raise ValueError(f"{option} {value}: peagle runs on one device (1)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, the format peagle parses)")
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other: give one")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.engine_thread and (args.engine_process or args.api_server_count > 1):
        raise ValueError("--engine-thread runs the engine inside the one API server: it goes with neither "
                         "--engine-process nor --api-server-count > 1")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 (seconds), got {args.shutdown_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1 (tokens), got {args.stream_interval}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
    for option, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path and not Path(path).is_file():
            raise ValueError(f"{option}: no such file {path!r}")
    template = load_chat_template(args.chat_template) if args.chat_template else None  # before the model loads
    defaults = model_sampling_defaults(args.generation_config, args.model)
    if template is not None and not args.tokenizer and not (Path(args.model) / "tokenizer.json").is_file():
        raise ValueError("--chat-template: this model directory has no tokenizer, so chat messages cannot be rendered")
    spec = (SpeculativeConfig.from_dict(args.speculative_config) if args.speculative_config
            else SpeculativeConfig.from_env())
    device = args.device or _default_device()
    config = EngineConfig(
        model=args.model, dtype=resolve_dtype(args.dtype, device), device=device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager, seed=args.seed, speculative=spec, async_scheduling=args.async_scheduling,
        enable_chunked_prefill=args.enable_chunked_prefill, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_cuda_graphs=args.prefill_cuda_graphs, enable_prefix_caching=args.enable_prefix_caching,
        load_format=args.load_format, block_size=args.block_size,
        draft_confidence_cutoff=args.draft_confidence_cutoff,
        synthetic_acceptance=args.synthetic_acceptance,
    )
    ModelConfig.from_dir(args.model)  # a wrong directory is refused here, not by the engine process it would start
    check_max_model_len(config)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None  # before the model loads
    if args.reasoning_parser and (tokenizer or (Path(args.model) / "tokenizer.json").is_file()):
        REASONING_PARSERS[args.reasoning_parser].end_token_id(tokenizer or load_tokenizer(args.model))
    return launch(args, config, template, defaults, tokenizer=tokenizer)


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates such as 0.6,0.3, got {text!r}") from None


def _json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\', got {text!r}') from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\', got {text!r}')
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the port must be a number in 1..65535, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be in 1..65535, got {port}")
    return port


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
