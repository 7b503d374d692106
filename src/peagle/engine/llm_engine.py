"""The engine loop: schedule, run, commit. Servers and benchmarks drive it step by step."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle.engine.attention import AttentionOptions
from peagle.engine.config import EngineConfig
from peagle.engine.draft_plan import DraftPlanner
from peagle.engine.model_runner import ModelRunner, StepHandle, StepResult
from peagle.engine.outputs import RequestMetrics, StepOutput
from peagle.engine.sampler import SamplingTensors, build_sampling_tensors
from peagle.engine.sampling_params import SamplingParams, truncate_prompt, with_bad_words
from peagle.engine.scheduler import Scheduler, SchedulerConfig
from peagle.engine.sequence import Sequence
from peagle.engine.spec.proposer import Eagle3Proposer, ParallelDraftingProposer
from peagle.engine.stats import EngineStats
from peagle.kernels import compile_watch
from peagle.models.config import ModelConfig
from peagle.models.loader import random_model

logger = logging.getLogger(__name__)

_ACTIVATION_RESERVE = 2 << 30  # bytes kept free for activations, logits and graphs


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from peagle.models.loader import load_model, load_tokenizer

        self.config = config
        self.device = _device(config.device)
        if self.device.type == "cuda":
            compile_watch.WATCH.install()
        self.dtype = getattr(torch, config.dtype)
        torch.manual_seed(config.seed)
        self.model_config = ModelConfig.from_dir(config.model)
        has_tokenizer = (Path(config.model) / "tokenizer.json").is_file()
        self.tokenizer = load_tokenizer(config.model) if has_tokenizer else None
        if config.load_format == "dummy":
            self.target = random_model(self.model_config, self.dtype, self.device, config.seed)
        else:
            self.target = load_model(config.model, dtype=self.dtype, device=self.device)
        if config.decode_gemv:
            from peagle.kernels import use_gemv_linears

            use_gemv_linears(self.target)
        self.spec = config.speculative
        drafter, proposer_cls = self._load_drafter()
        self.k = self.spec.num_speculative_tokens if self.spec else 0
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.planner = DraftPlanner(self.k, self.spec.adaptive if self.spec else None,
                                    propose_verified_only=config.propose_verified_only,
                                    max_model_len=self.max_model_len,
                                    confidence_cutoff=config.draft_confidence_cutoff)
        # MASK slots and verify rows run up to 2K positions past the last token.
        need = self.max_model_len + 2 * self.k + 1
        for m in (self.target, drafter):
            if m is not None and m.rope.max_positions < need:
                m.rope.max_positions = need
        block_size = config.block_size
        num_blocks = self._num_blocks(drafter)
        # Without chunked prefill a step must hold a whole prompt; with it, vLLM's server default of 2048.
        whole = 2048 if config.enable_chunked_prefill else self.max_model_len
        max_batched = config.max_num_batched_tokens or max(whole, config.max_num_seqs * (self.k + 1))
        if config.synthetic_acceptance is not None:
            logger.warning("SYNTHETIC ACCEPTANCE IS ON: drafts are accepted by dice with per-position rates %s, not "
                           "by the target; outputs are meaningless. Benchmarking only.", config.synthetic_acceptance)
        self.runner = ModelRunner(
            self.target, drafter, proposer_cls, planner=self.planner, block_size=block_size, num_blocks=num_blocks,
            max_model_len=self.max_model_len, device=self.device, dtype=self.dtype,
            attention=AttentionOptions(config.fused_merge, config.mixed_tiles), max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_batched,
            synthetic_acceptance=config.synthetic_acceptance, cuda_graphs=not config.enforce_eager,
            prefill_cuda_graphs=config.prefill_cuda_graphs, async_copies=config.async_scheduling,
        )
        graphs, reserve = self.runner.graphs, self.activation_reserve()
        if graphs is not None and graphs.memory > reserve // 2:
            logger.warning("the decode CUDA graphs took %.1f GiB of the %.1f GiB kept free beside the KV cache; if "
                           "steps run out of GPU memory, lower gpu_memory_utilization", graphs.memory / 2**30,
                           reserve / 2**30)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=self.max_model_len,
            block_size=block_size, num_blocks=num_blocks, num_lookahead_slots=2 * self.k,
            enable_chunked_prefill=config.enable_chunked_prefill, enable_prefix_caching=config.enable_prefix_caching,
        ))
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer
                                       else self.model_config.eos_token_ids)
        self._generators: dict[str, torch.Generator] = {}
        self._inflight: _Launched | None = None  # async scheduling: the step whose answer is on its way
        logger.info("engine ready: %s, %d KV blocks of %d, K=%d", config.model, num_blocks, block_size, self.k)
        if self.device.type == "cuda":
            logger.info("Triton built %d kernel variants while the engine started (%.1f s)", compile_watch.WATCH.count,
                        compile_watch.WATCH.seconds)

    def use_tokenizer(self, tokenizer) -> None:
        """Tokenize, detokenize and stop with `tokenizer` (another directory's, as vLLM's --tokenizer): requests end
        at its EOS tokens and at the model config's (vLLM stops at the tokenizer's EOS and the model's
        generation config's)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)

    # ---- construction ------------------------------------------------------------------------------------------

    def general_graphs(self, capture: bool = True):
        """Graphs for general steps (prefill_cuda_graphs): `ModelRunner.build_general_graphs`."""
        return self.runner.build_general_graphs(capture)

    def _load_drafter(self):
        if self.spec is None:
            return None, None
        from peagle.drafters import Drafter, load_drafter

        if self.spec.model == "dummy" and self.config.load_format == "dummy":
            method = "peagle" if self.spec.parallel_drafting or self.spec.method == "peagle" else "eagle3"
            mask = self.model_config.vocab_size - 1 if method == "peagle" else None  # random weights: any id will do
            drafter = Drafter.for_target(self.target, method, seed=self.config.seed, mask_token_id=mask)
            drafter = drafter.to(self.device, self.dtype).eval().requires_grad_(False)
        else:
            drafter = load_drafter(self.spec.model, self.model_config, device=self.device, dtype=self.dtype,
                                   target=self.target)
        parallel = self.spec.parallel_drafting
        if self.spec.method == "peagle":
            parallel = True
        if parallel is None:
            parallel = drafter.config.method == "peagle"
        if parallel and drafter.config.method != "peagle":
            raise ValueError(
                f"parallel_drafting needs a P-EAGLE head (mask token and mask_hidden); {self.spec.model} is an "
                f"{drafter.config.method} head: drop parallel_drafting or use a P-EAGLE checkpoint"
            )
        return drafter, (ParallelDraftingProposer if parallel else Eagle3Proposer)

    def activation_reserve(self) -> int:
        """Bytes kept free beside the KV cache: _ACTIVATION_RESERVE, plus, as the vocabulary and the decode batch
        grow, three fp32 logits tensors of the largest decode step (the graphs' shared output, and that step's
        logits and probabilities while it runs)."""
        rows = self.config.max_num_seqs * (self.k + 1)
        return _ACTIVATION_RESERVE + 3 * 4 * rows * self.model_config.vocab_size

    def _num_blocks(self, drafter) -> int:
        cfg = self.config
        per_block = ModelRunner.kv_block_bytes(self.target, drafter, cfg.block_size, self.dtype)
        per_seq = -(-(self.max_model_len + 2 * self.k + 1) // cfg.block_size)
        useful = cfg.max_num_seqs * per_seq
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type != "cuda":
            return min(useful, max(per_seq, (1 << 30) // per_block))
        # An engine dropped earlier in this process may still hold the GPU through reference cycles: collect it
        # before measuring what is free.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * cfg.gpu_memory_utilization - (total - free) - self.activation_reserve()
        blocks = int(budget // per_block)
        if blocks < per_seq:
            raise ValueError(
                f"not enough GPU memory for one {self.max_model_len}-token sequence's KV cache "
                f"({blocks} blocks fit; {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB already in use, "
                f"this engine's weights included); raise gpu_memory_utilization, lower max_model_len, or free "
                f"what else holds the GPU (another LLM still referenced in this process, another process)"
            )
        return min(blocks, useful)

    # ---- requests ----------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None) -> Sequence:
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        prompt_token_ids = self.truncated_prompt(prompt_token_ids, sampling_params)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            ids = getattr(sampling_params, name) or ()
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab})")
        sampling_params = with_bad_words(sampling_params, self.tokenizer, vocab)
        if sampling_params.structured_outputs is not None:  # llguidance is loaded for structured requests only
            from peagle.engine.structured_output import with_grammar

            sampling_params = with_grammar(sampling_params, self.tokenizer, vocab)
        seq = Sequence(request_id, prompt_token_ids, sampling_params,
                       time.monotonic() if arrival_time is None else arrival_time, self.eos_token_ids)
        if sampling_params.prompt_logprobs is not None and len(prompt_token_ids) < self.max_model_len:
            # a forward of its own over the prompt, before the request is queued (the scheduler refuses a prompt
            # too long for the context without running it)
            seq.prompt_logprobs = self.runner.prompt_logprobs(prompt_token_ids, sampling_params.prompt_logprobs)
        self.scheduler.add(seq)
        if sampling_params.seed is not None and not sampling_params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sampling_params.seed)
            self._generators[request_id] = gen
        return seq

    def truncated_prompt(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> list[int]:
        """The prompt after the request's truncate_prompt_tokens (sampling_params.truncate_prompt)."""
        return truncate_prompt(prompt_token_ids, sampling_params.truncate_prompt_tokens, self.max_model_len)

    def abort_request(self, request_id: str) -> bool:
        self._generators.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, bm.num_used_blocks,
                           self.scheduler.config.num_blocks)

    # ---- the loop ----------------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        if self.config.async_scheduling:
            return self._step_async()
        sched, drafts, chunks, load_k = self._schedule()
        outputs: list[StepOutput] = []
        if sched.seqs:
            st = self._sampling_tensors(sched.seqs)
            plan = self.planner.plan(sched.seqs, drafts, load_k, logits_processing=st.processing is not None,
                                     chunks=chunks)
            self._note_drafting(sched.seqs, plan.draft)
            self._set_cutoff(self.scheduler.num_running)
            result = self.runner.execute(sched.seqs, drafts, st, plan, chunks=chunks)
            outputs = self._commit(_Launched(sched.seqs, None, chunks), result)
        return self._release(outputs)

    def _step_async(self) -> list[StepOutput]:
        """Async scheduling: launch the next step first, then wait for the answer of the one in flight and commit
        it, so that committing, stop checks and the caller's work on the outputs run while the GPU computes.

        The next step is launched before the answer only when the batch in flight can decode on as it is
        (`Scheduler.schedule_ahead`); its inputs are then built on the device from that answer. Otherwise (new
        prompts to admit, preemption, logits processing that reads the history) the answer is committed first and
        the step is scheduled as without async scheduling. A request that finished in the step in flight runs one
        more step, whose answer is dropped. Steps return the outputs of the step before: the first returns none.
        """
        prev, self._inflight = self._inflight, None
        ahead = self._launch_ahead(prev) if prev is not None else None
        outputs: list[StepOutput] = []
        if prev is not None:
            outputs = self._commit(prev, prev.handle.result(), None if ahead is None else ahead.handle.k)
        if ahead is None:
            sched, drafts, chunks, load_k = self._schedule()
            if sched.seqs:
                st = self._sampling_tensors(sched.seqs)
                plan = self.planner.plan(sched.seqs, drafts, load_k, logits_processing=st.processing is not None,
                                         chunks=chunks)
                self._note_drafting(sched.seqs, plan.draft)
                cutoff = self._set_cutoff(self.scheduler.num_running)
                ahead = _Launched(sched.seqs, self.runner.launch(sched.seqs, drafts, st, plan, chunks), chunks,
                                  cutoff)
        self._inflight = ahead
        return self._release(outputs)

    def _launch_ahead(self, prev: _Launched) -> _Launched | None:
        """The decode step after `prev`, launched before prev's answer arrived; None when it needs the answer."""
        if prev.chunks is not None:
            return None  # a prefill chunk's answer is no next token
        handle = prev.handle
        rows = [i for i, seq in enumerate(prev.seqs) if not seq.is_finished]
        seqs = [prev.seqs[i] for i in rows]
        if any(seq.sampling_params.needs_logits_processing for seq in seqs):
            return None  # penalties, min_tokens and grammars read the history and drafts the answer in flight holds
        admitting = self.config.admit_ahead and self._can_admit_ahead()
        plan = self.planner.plan_ahead(len(seqs), handle.num_drafts, admitting=admitting)
        if plan is None:
            return None  # the load's K rose: a step scheduled from the answer proposes the new count (padded)
        k = plan.verify_k
        # drafts in flight cut by confidence: each request feeds the ones it holds, packed on the device
        budget = self.planner.compact_budget([len(seq.draft_token_ids) for seq in seqs], k) \
            if k and prev.cutoff > 0 else None
        if admitting:
            new = self.scheduler.admit_ahead(seqs, handle.k + 1, k + 1)
            if not new:
                return None
            batch = new + seqs
            cutoff = self._set_cutoff(len(seqs))
            st = self._sampling_tensors(batch)
            if budget is not None:
                return _Launched(batch, self.runner.launch_compact(handle, rows, seqs, new, st, plan, budget),
                                 cutoff=cutoff)
            return _Launched(batch, self.runner.launch_admit_next(handle, rows, seqs, new, st, plan), cutoff=cutoff)
        if not self.scheduler.schedule_ahead(seqs, handle.k + 1, k + 1):
            return None
        self._note_drafting(seqs, plan.draft)
        cutoff = self._set_cutoff(len(seqs))
        st = self._sampling_tensors(seqs)
        if budget is not None:
            return _Launched(seqs, self.runner.launch_compact(handle, rows, seqs, [], st, plan, budget),
                             cutoff=cutoff)
        return _Launched(seqs, self.runner.launch_next(handle, rows, seqs, st, plan), cutoff=cutoff)

    def _set_cutoff(self, num_running: int) -> float:
        """The draft confidence cutoff of the step about to launch, at the load it runs under (0: none)."""
        cutoff = self.planner.cutoff(num_running) if self.planner.confident else 0.0
        self.runner.set_cutoff(cutoff)
        return cutoff

    def _note_drafting(self, seqs: list[Sequence], draft: bool):
        """A step that feeds sequences without running the drafter leaves their drafter entries unwritten there:
        prefix caching then names none of their answer's blocks (block_manager)."""
        if not draft and self.spec is not None:
            for seq in seqs:
                seq.drafter_gap = True

    def _can_admit_ahead(self) -> bool:
        """Prompts wait, there is room for one, and none of them needs logits processing (it reads the history)."""
        sched = self.scheduler
        return (bool(sched.waiting) and sched.num_running < sched.config.max_num_seqs
                and not any(seq.sampling_params.needs_logits_processing for seq in sched.waiting))

    def _schedule(self):
        """The next step from the committed state: its scheduler output, each request's drafts, the tokens each
        request feeds when a prefill is chunked (else None), and the load's K (`DraftPlanner.load_k`: the drafts
        the step verifies at most), for the step's DraftPlan (`DraftPlanner.plan`)."""
        load_k = self.planner.load_k(self.scheduler.num_running)
        self.planner.trim(self.scheduler.running, load_k)  # before scheduling, whose token budget counts the drafts
        sched = self.scheduler.schedule()
        counts = sched.num_scheduled_tokens
        chunks = counts if any(n < s.num_new_tokens for s, n in zip(sched.seqs, counts)) else None
        return sched, [s.draft_token_ids for s in sched.seqs], chunks, load_k

    def _commit(self, step: _Launched, result: StepResult, next_k: int | None = None) -> list[StepOutput]:
        """Apply a step's answer. `next_k`: the drafts the step launched after it verifies (async scheduling)."""
        now = time.monotonic()
        outputs = []
        logprobs = result.logprobs or [None] * len(step.seqs)
        chunks = step.chunks or [None] * len(step.seqs)
        for seq, tokens, drafts, lps, n, verified in zip(step.seqs, result.output_tokens, result.drafts, logprobs,
                                                         chunks, result.num_verified):
            if seq.is_finished:  # finished or aborted while its step was in flight: the answer is dropped
                continue
            if n is not None and n < seq.num_new_tokens:  # a prefill chunk: nothing sampled
                seq.commit_chunk(n)
                continue
            before = seq.num_tokens
            seq.commit(tokens, now, verified)
            self._check_stop_strings(seq, before)
            if not seq.is_finished and self.k:
                seq.set_drafts(drafts if next_k is None else drafts[:next_k])
            new = seq.token_ids[before:]
            outputs.append(StepOutput(seq.seq_id, new, seq.is_finished,
                                      logprobs=None if lps is None else lps[:len(new)]))
        return outputs

    def _release(self, outputs: list[StepOutput]) -> list[StepOutput]:
        by_id = {o.request_id: o for o in outputs}
        now = time.monotonic()
        for seq in self.scheduler.release_finished():
            self._generators.pop(seq.seq_id, None)
            out = by_id.get(seq.seq_id)
            if out is None:  # finished without running this step: refused prompt, out of KV
                out = StepOutput(seq.seq_id, [], True)
                outputs.append(out)
            out.finished, out.finish_reason, out.error = True, seq.finish_reason, seq.error
            out.metrics = RequestMetrics.of(seq, now)
        return outputs

    def _check_stop_strings(self, seq: Sequence, before: int):
        stops = seq.sampling_params.stop
        if not stops or self.tokenizer is None:
            return
        out_start = seq.num_prompt_tokens
        # A stop string completed by a new token lies within the last few tokens: every token decodes to at least
        # one character except byte pieces of one character (at most 4), so decode only that window.
        window = 4 * max(len(s) for s in stops) + 8
        # As in vLLM, stop strings are not looked for before min_tokens outputs.
        first = out_start + max(1, seq.sampling_params.min_tokens)
        for end in range(max(before, first), seq.num_tokens + 1):
            text = self.tokenizer.decode(seq.token_ids[max(out_start, end - window):end])
            if any(s in text for s in stops):
                del seq.token_ids[end:]
                self.scheduler.finish(seq, "stop")
                return

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        gens = [self._generators.get(s.seq_id) for s in seqs]
        return build_sampling_tensors(seqs, gens, self.model_config.vocab_size, self.device)

    def text_of(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer else ""


@dataclass
class _Launched:
    """A launched step: its batch, the answer's handle (None once read), the tokens each request fed when a
    prefill was chunked (None when every request fed its whole span), and its cutoff."""

    seqs: list[Sequence]
    handle: StepHandle | None
    chunks: list[int] | None = None
    cutoff: float = 0.0  # the draft confidence cutoff its proposer ran with (> 0: its drafts may hold PAD_DRAFT)




def _device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available; pass device='cpu'")
    return dev
