"""Scheduler: continuous batching over the paged KV cache, with preemption by recompute.

Each `schedule()` builds one step:
1. Running sequences, oldest first, as decodes (`num_new_tokens` = 1 + drafts each) while the token budget
   allows. Each gets blocks for `num_tokens + num_lookahead_slots` slots; when the cache runs out, the most
   recently admitted running sequence not yet in this step is preempted by recompute (its blocks freed, back to
   the front of the waiting queue). A sequence that has nobody left to preempt goes back to waiting itself, or,
   when it runs alone and still does not fit, finishes with "length": the cache cannot hold it.
2. Waiting sequences, in order, as prefills of their whole uncomputed span, while `max_num_seqs`, the token
   budget and free blocks allow; none are admitted in a step that preempted.
The batch is empty only when nothing is left waiting or running, so the engine loop cannot livelock.

With `enable_chunked_prefill` (vLLM's name) a prefill that does not fit the step's remaining token budget runs in
chunks: it takes what the decodes left, and continues in later steps, after every running decode. A long prompt then
delays the running decodes by at most one step of `max_num_batched_tokens` tokens, instead of running whole in one
step. `SchedulerOutput.num_scheduled_tokens` says how many tokens each sequence feeds; a chunk that ends before the
uncomputed span does samples nothing (`seq.commit_chunk`).

The engine's step: `out = schedule()`; run `out.seqs` (may be empty: skip the model); `seq.commit(new_token_ids)`
for each; `scheduler.finish(seq, "stop")` on a stop string; set `seq.draft_token_ids` for the next verification
of each unfinished sequence; `release_finished()` for the sequences to report as done (including requests
refused by `add` and those the cache could not hold). Loop while `has_unfinished()`.

With async scheduling the engine launches the next step before the answer of the one in flight arrives: when
`schedule_ahead` accepts the batch in flight as the next decode step (the common steady state), the model runner
builds its inputs on the device from the step in flight; otherwise the engine waits for the answer and calls
`schedule()` as above.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from peagle.engine.block_manager import BlockManager
from peagle.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Scheduling limits. `num_lookahead_slots` is 2K with K speculative tokens (verify writes K+1 positions,
    the drafter up to 2K-1 ahead of the sequence), 0 without speculation."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    num_lookahead_slots: int = 0
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False  # prompts start from the cached blocks of earlier prompts (block_manager.py)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2 (a prompt token and an output), "
                             f"got {self.max_model_len!r}")
        if not isinstance(self.num_lookahead_slots, int) or self.num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be an int >= 0, got {self.num_lookahead_slots!r}")
        if self.max_num_batched_tokens < self.max_model_len and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}): prompts and recomputed sequences are prefilled in one step "
                f"(or turn on enable_chunked_prefill)"
            )
        per_decode = 1 + self.num_lookahead_slots // 2  # the last token and K drafts
        if self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_num_seqs * per_decode:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs x (1 + K) "
                f"({self.max_num_seqs * per_decode}) with enable_chunked_prefill: prefill chunks get what the "
                f"decodes leave, and would starve behind a full batch of decodes"
            )
        if self.max_num_batched_tokens < 1 + self.num_lookahead_slots:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= 1 + num_lookahead_slots "
                f"({self.num_lookahead_slots}) to verify one request's drafts"
            )


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    seqs: list[Sequence]  # the step's batch: the first num_prefill are prefills, the rest decodes
    num_prefill: int
    preempted: list[Sequence]  # preempted by recompute during this call (now waiting, without blocks)
    num_scheduled_tokens: list[int]  # per sequence: tokens fed, seq.num_new_tokens unless a prefill chunk


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()  # no blocks; front is next to admit
        self.running: list[Sequence] = []  # hold blocks; in admission order
        self._finished: list[Sequence] = []  # finished, blocks freed, not yet released
        self._seqs: dict[str, Sequence] = {}  # every sequence not yet released, by id

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting, running, or finished but not yet returned by `release_finished`."""
        return bool(self._seqs)

    def add(self, seq: Sequence):
        """Queue a new sequence. A prompt that can never run finishes at once with "error" (see `seq.error`)."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"request id {seq.seq_id!r} is already in use")
        assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq.num_computed_tokens == 0
        limit = self.config.max_model_len
        seq.max_model_len = limit if seq.max_model_len is None else min(seq.max_model_len, limit)
        self._seqs[seq.seq_id] = seq
        error = self._prompt_error(seq)
        if error is not None:
            seq.finish("error", error)
            self._finished.append(seq)
            return
        self.waiting.append(seq)

    def _prompt_error(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        if n == 0:
            return "the prompt is empty"
        if n > seq.max_model_len - 1:
            return (f"the prompt has {n} tokens; at most {seq.max_model_len - 1} fit "
                    f"(max_model_len {seq.max_model_len} minus one output token)")
        needed = self.block_manager.blocks_needed(n + self.config.num_lookahead_slots)
        if needed > self.config.num_blocks:
            return (f"the prompt needs {needed} KV blocks but the cache has {self.config.num_blocks} "
                    f"(block_size {self.config.block_size})")
        return None

    def schedule(self) -> SchedulerOutput:
        self._reap()
        chunks: dict[int, int] = {}  # id(seq) -> tokens fed, for prefill chunks
        decodes, prefilling, preempted, num_tokens = self._schedule_running(chunks)
        admitted = [] if preempted else self._admit_waiting(num_tokens, chunks)
        seqs = admitted + prefilling + decodes
        counts = [chunks.get(id(seq), seq.num_new_tokens) for seq in seqs]
        for seq, count in zip(seqs[:len(admitted) + len(prefilling)], counts):  # after the step's own lookups
            self.block_manager.register(seq, seq.num_computed_tokens + count)
        return SchedulerOutput(seqs, len(admitted) + len(prefilling), preempted, counts)

    def schedule_ahead(self, seqs: list[Sequence], num_inflight_tokens: int, num_new_tokens: int) -> bool:
        """Async scheduling: reserve blocks for the step after the one in flight, before its answer arrives.

        `seqs` are the unfinished sequences of the step in flight, each of which will gain up to
        `num_inflight_tokens` tokens from it that the host has not seen, then feed `num_new_tokens` (its last token
        and drafts) in the next step. True when that step can run them as they are: nothing waits for admission,
        every running sequence is among them, the token budget holds them, none can reach max_model_len, and
        their blocks (for the most tokens they can have) fit without preemption. False means the full
        `schedule()` must decide after the answer arrives; blocks given here before a False stay with their
        sequences (the next reservation would ask for them anyway).
        """
        cfg = self.config
        if self.waiting and len(self.running) < cfg.max_num_seqs:
            return False
        return self._reserve_ahead(seqs, num_inflight_tokens, num_new_tokens)

    def _reserve_ahead(self, seqs: list[Sequence], num_inflight_tokens: int, num_new_tokens: int) -> bool:
        """`schedule_ahead`'s checks of the batch in flight, and its blocks for the most tokens it can have."""
        cfg = self.config
        if not seqs or len(seqs) != len(self.running):
            return False
        if len(seqs) * num_new_tokens > cfg.max_num_batched_tokens:
            return False
        most = [seq.num_tokens + num_inflight_tokens for seq in seqs]
        if any(n + num_new_tokens - 1 > cfg.max_model_len for n in most):
            return False  # the drafts would be cut to fit: the host must see the answer first
        for seq, n in zip(seqs, most):
            assert seq.status is SequenceStatus.RUNNING, seq
            num_slots = n + cfg.num_lookahead_slots
            if not self.block_manager.can_allocate(seq, num_slots):
                return False
            self.block_manager.allocate(seq, num_slots)
        return True

    def admit_ahead(self, seqs: list[Sequence], num_inflight_tokens: int, num_new_tokens: int) -> list[Sequence]:
        """Async scheduling with prompts waiting: `schedule_ahead`'s batch plus waiting prompts admitted whole, so that
        the step that admits them is launched before the answer in flight arrives (the GPU is not left idle while the
        host builds it). The prompts come first in the step, as in `schedule()`; each is admitted only if it fits the
        token budget after the decodes, a free request slot and its blocks, none chunked. Returns the admitted
        sequences (now running), or [] when the step must be scheduled after the answer arrives (nothing admitted;
        blocks reserved for `seqs` before that stay with them, as in `schedule_ahead`)."""
        cfg = self.config
        if not self.waiting or len(self.running) >= cfg.max_num_seqs:
            return []
        budget = cfg.max_num_batched_tokens - len(seqs) * num_new_tokens
        first = self.waiting[0]
        cached = self.block_manager.cached_prefix(first)
        if self._uncached(first, cached) > budget or not self.block_manager.can_allocate(
                first, first.num_tokens + cfg.num_lookahead_slots, cached):
            return []  # the first prompt waits for the answer either way: chunked, or the cache must make room
        if not self._reserve_ahead(seqs, num_inflight_tokens, num_new_tokens):
            return []
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            num_slots = seq.num_tokens + cfg.num_lookahead_slots
            cached = self.block_manager.cached_prefix(seq)
            if self._uncached(seq, cached) > budget or not self.block_manager.can_allocate(seq, num_slots, cached):
                break
            self._admit(seq, cached, num_slots)
            admitted.append(seq)
            budget -= seq.num_new_tokens
        for seq in admitted:  # after every lookup of this step
            self.block_manager.register(seq, seq.num_tokens)
        return admitted

    def _uncached(self, seq: Sequence, cached: list[int]) -> int:
        """The tokens `seq` feeds once it has taken the `cached` prefix blocks."""
        return seq.num_new_tokens - len(cached) * self.config.block_size

    def _admit(self, seq: Sequence, cached: list[int], num_slots: int):
        self.waiting.popleft()
        if cached:
            self.block_manager.take_cached_prefix(seq, cached)
        self.block_manager.allocate(seq, num_slots)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _schedule_running(self, chunks: dict[int, int]):
        """Running decodes, oldest first; then, with chunked prefill, the running sequences still prefilling."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        chunked = self.config.enable_chunked_prefill
        num_tokens = 0
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or (chunked and _is_prefilling(seq)):
                continue  # preempted earlier in this loop, or a prefill chunk: after the decodes
            assert len(seq.draft_token_ids) <= self.config.num_lookahead_slots, seq
            n = seq.num_new_tokens
            if num_tokens + n > budget:
                continue
            if self._reserve(seq, scheduled, preempted):
                scheduled.append(seq)
                num_tokens += n
        prefilling: list[Sequence] = []
        for seq in list(self.running) if chunked else []:
            if seq.status is not SequenceStatus.RUNNING or not _is_prefilling(seq) or num_tokens >= budget:
                continue
            if self._reserve(seq, scheduled + prefilling, preempted):
                n = min(seq.num_new_tokens, budget - num_tokens)
                chunks[id(seq)] = n
                prefilling.append(seq)
                num_tokens += n
        return scheduled, prefilling, preempted, num_tokens

    def _reserve(self, seq: Sequence, scheduled: list[Sequence], preempted: list[Sequence]) -> bool:
        """Give a running `seq` blocks for its next step, preempting younger sequences; False if it lost its place."""
        num_slots = seq.num_tokens + self.config.num_lookahead_slots
        while not self.block_manager.can_allocate(seq, num_slots):
            victim = self._pick_victim(seq, scheduled)
            if victim is None:
                if not scheduled:  # alone in the cache and still too long
                    self._finish_out_of_kv(seq, num_slots)
                    return False
                victim = seq
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_slots)
        return True

    def _pick_victim(self, seq: Sequence, scheduled: list[Sequence]) -> Sequence | None:
        for candidate in reversed(self.running):
            if candidate is not seq and candidate not in scheduled:
                return candidate
        return None

    def _admit_waiting(self, num_tokens: int, chunks: dict[int, int]) -> list[Sequence]:
        cfg = self.config
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            num_slots = seq.num_tokens + cfg.num_lookahead_slots
            if self.block_manager.blocks_needed(num_slots) > cfg.num_blocks:
                self.waiting.popleft()
                self._finish_out_of_kv(seq, num_slots)
                continue
            cached = self.block_manager.cached_prefix(seq)
            whole = n = self._uncached(seq, cached)
            if num_tokens + n > cfg.max_num_batched_tokens:
                if not cfg.enable_chunked_prefill or num_tokens >= cfg.max_num_batched_tokens:
                    break
                n = cfg.max_num_batched_tokens - num_tokens
            if not self.block_manager.can_allocate(seq, num_slots, cached):
                break
            if n < whole:
                chunks[id(seq)] = n
            self._admit(seq, cached, num_slots)
            admitted.append(seq)
            num_tokens += n
        return admitted

    def _preempt(self, seq: Sequence):
        logger.debug("preempting %s by recompute (%d blocks free)", seq, self.block_manager.num_free_blocks)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _finish_out_of_kv(self, seq: Sequence, num_slots: int):
        message = (f"the KV cache ({self.config.num_blocks} blocks of {self.config.block_size}) cannot hold "
                   f"{num_slots} slots for this request alone; stopped after {seq.num_output_tokens} output tokens")
        logger.warning("request %s: %s", seq.seq_id, message)
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.finish("length", message)
        self._finished.append(seq)

    def finish(self, seq: Sequence, reason: str, error: str | None = None):
        """Finish `seq` (e.g. "stop" on a stop string, "error" on a failure) and free its blocks now.

        On a sequence that already finished (e.g. "length" in the same step) only the reason changes."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        else:  # finished and reaped already
            seq.finish(reason, error)
            return
        self.block_manager.free(seq)
        seq.finish(reason, error)
        self._finished.append(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish an unfinished sequence with "abort" and free its blocks now. It is returned here and not again
        by `release_finished`; None if the id is unknown or the sequence already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.is_finished:
            return None
        self.finish(seq, "abort")
        self._finished.remove(seq)
        del self._seqs[seq_id]
        return seq

    def _reap(self):
        """Move sequences that finished during a step out of `running`, freeing their blocks."""
        if not any(seq.is_finished for seq in self.running):
            return
        for seq in self.running:
            if seq.is_finished:
                self.block_manager.free(seq)
                self._finished.append(seq)
        self.running = [seq for seq in self.running if not seq.is_finished]

    def release_finished(self) -> list[Sequence]:
        """Return every sequence finished since the last call (their blocks are free) and forget them."""
        self._reap()
        finished, self._finished = self._finished, []
        for seq in finished:
            del self._seqs[seq.seq_id]
        return finished


def _is_prefilling(seq: Sequence) -> bool:
    """More than the last token is uncomputed: a prompt (or a recomputed sequence) not yet fully fed."""
    return seq.num_tokens - seq.num_computed_tokens > 1
