"""Turning target logits into probabilities under each request's sampling parameters, on the device.

Greedy rows get an exact one-hot distribution on their argmax, so one rejection-sampling path (spec/verifier.py)
serves greedy and sampled requests alike and greedy output stays identical to plain argmax decoding.

Logits processing (penalties, logit_bias, allowed_token_ids, min_tokens) runs per verified row before any of
that. Row j of a request (j = 0..K) scores the token after its history plus drafts 0..j-1, so the drafted tokens
before a row count as history there: every row sees exactly what plain decoding would have seen had the drafts
before it been emitted, which keeps speculation lossless with processing on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsProcessing:
    """The step's processed requests (P of the batch's B) and what changes their logits, as device tensors."""

    requests: torch.Tensor  # [P] int64 batch indices
    bias: torch.Tensor | None  # [P, V] fp32 added to every row: logit_bias, -inf outside allowed_token_ids
    min_tokens_left: torch.Tensor | None  # [P] int64 outputs still due before a stop token may come (<= 0: none)
    stop_mask: torch.Tensor | None  # [P, V] bool: EOS (unless ignore_eos) and stop_token_ids
    output_counts: torch.Tensor | None  # [P, V] fp32 occurrences of each id among the outputs so far
    prompt_mask: torch.Tensor | None  # [P, V] bool ids in the prompt (repetition penalty)
    presence: torch.Tensor | None  # [P] fp32
    frequency: torch.Tensor | None  # [P] fp32
    repetition: torch.Tensor | None  # [P] fp32, 1 = off
    allowed: torch.Tensor | None = None  # [P, R, V] bool: structured output's grammar, per verified row


@dataclass
class SamplingTensors:
    """Per-request sampling parameters as device tensors, built once per step on the host."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32, 1 = off
    all_greedy: bool
    needs_filter: bool
    generators: list[torch.Generator | None]  # per request, for seeded requests
    min_p: torch.Tensor | None = None  # [B] fp32, 0 = off; None when no request uses it
    processing: LogitsProcessing | None = None
    logprob_requests: torch.Tensor | None = None  # [L] int64 batch indices of requests that want logprobs
    num_logprobs: int = 0  # top alternatives per token (the largest any of those requests asked)
    any_greedy: bool = True  # some request is greedy (its rows become one-hot); False skips that work


def build_sampling_tensors(seqs, generators: list[torch.Generator | None], vocab_size: int,
                           device: torch.device) -> SamplingTensors:
    """The step's SamplingTensors from its scheduled sequences (duck-typed engine Sequences)."""
    params = [s.sampling_params for s in seqs]
    all_greedy = all(p.greedy for p in params)
    processing = _processing(seqs, vocab_size, device, max((len(s.draft_token_ids) for s in seqs), default=0) + 1)
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    logprob_requests = upload(torch.tensor(want, dtype=torch.long), device) if want else None
    num_logprobs = max((params[b].logprobs for b in want), default=0)
    if all_greedy:
        z = torch.zeros(0, device=device)
        return SamplingTensors(z, z.long(), z, True, False, [], None, processing, logprob_requests, num_logprobs)
    # One upload for the four per-request columns (top_k travels as fp32: exact below 2**24, any vocabulary's size).
    use_min_p = any(p.min_p for p in params)
    table = upload(torch.tensor([[0.0 if p.greedy else p.temperature for p in params],
                                 [max(p.top_k, 0) for p in params],
                                 [p.top_p for p in params],
                                 [p.min_p for p in params]], dtype=torch.float32), device)
    temp, top_k, top_p = table[0], table[1].long(), table[2]
    min_p = table[3] if use_min_p else None
    needs_filter = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
    return SamplingTensors(temp, top_k, top_p, False, needs_filter, generators, min_p, processing,
                           logprob_requests, num_logprobs, any(p.greedy for p in params))


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the host this step, on `device` without waiting for the stream.

    A copy to the GPU from pageable memory synchronises the stream before it starts (a CUDA rule), so it would hold
    the host behind the step in flight and undo async scheduling's overlap; a copy from pinned memory is queued like a
    kernel. The pinned block comes from torch's caching host allocator, which keeps it until the copy has run.
    """
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _processing(seqs, vocab: int, device: torch.device, rows: int) -> LogitsProcessing | None:
    chosen = [b for b, s in enumerate(seqs) if s.sampling_params.needs_logits_processing]
    if not chosen:
        return None
    seqs = [seqs[b] for b in chosen]
    params = [s.sampling_params for s in seqs]
    p = len(seqs)
    bias = None
    if any(q.logit_bias or q.allowed_token_ids is not None for q in params):
        bias = torch.zeros(p, vocab)
        for i, q in enumerate(params):
            if q.allowed_token_ids is not None:
                bias[i].fill_(float("-inf"))
                bias[i, [t for t in q.allowed_token_ids if t < vocab]] = 0.0
            for t, v in (q.logit_bias or {}).items():
                if t < vocab:
                    bias[i, t] += v
    left = stop_mask = None
    if any(q.min_tokens for q in params):
        left = torch.tensor([q.min_tokens - s.num_output_tokens for q, s in zip(params, seqs)])
        stop_mask = torch.zeros(p, vocab, dtype=torch.bool)
        for i, (q, s) in enumerate(zip(params, seqs)):
            ids = set(q.stop_token_ids) | (set() if q.ignore_eos else set(s.eos_token_ids))
            stop_mask[i, [t for t in ids if t < vocab]] = True
    counts = prompt_mask = presence = frequency = repetition = None
    if any(q.has_penalties for q in params):
        counts = torch.zeros(p, vocab)
        prompt_mask = torch.zeros(p, vocab, dtype=torch.bool)
        for i, s in enumerate(seqs):
            out = torch.tensor(s.output_token_ids, dtype=torch.long)
            counts[i].index_add_(0, out, torch.ones(len(out)))
            prompt_mask[i, torch.tensor(s.token_ids[:s.num_prompt_tokens], dtype=torch.long)] = True
        presence = torch.tensor([q.presence_penalty for q in params])
        frequency = torch.tensor([q.frequency_penalty for q in params])
        repetition = torch.tensor([q.repetition_penalty for q in params])
    on = (lambda t: None if t is None else upload(t, device))  # noqa: E731
    return LogitsProcessing(upload(torch.tensor(chosen), device), on(bias), on(left), on(stop_mask), on(counts),
                            on(prompt_mask), on(presence), on(frequency), on(repetition),
                            on(_row_masks(seqs, vocab, rows)))


def _row_masks(seqs, vocab: int, rows: int) -> torch.Tensor | None:
    """[P, R, V] bool, per verified row: each structured request's grammar, then each request's bad words (all True
    for requests with neither), or None when no request has either."""
    if all(s.sampling_params.structured_outputs is None and not s.sampling_params.bad_words_token_ids
           for s in seqs):
        return None
    allowed = torch.ones(len(seqs), rows, vocab, dtype=torch.bool)
    for i, s in enumerate(seqs):
        grammar = s.sampling_params.compiled_grammar
        if s.sampling_params.structured_outputs is not None:
            assert grammar is not None, "the engine compiles a request's grammar when it is added"
            allowed[i] = torch.from_numpy(grammar.row_masks(s, s.draft_token_ids, rows))
        for j, banned in enumerate(bad_word_bans(s.sampling_params.bad_words_token_ids, s.output_token_ids,
                                                 s.draft_token_ids, rows)):
            allowed[i, j, banned] = False
    return allowed


def bad_word_bans(words: list[list[int]] | None, outputs: list[int], drafts: list[int], rows: int) -> list[list[int]]:
    """The token ids each verified row j may not emit (vLLM's bad words): a word's last token wherever the tokens
    before it end the row's output so far, the outputs then drafts 0..j-1 (the tokens row j follows)."""
    if not words:
        return [[] for _ in range(rows)]
    history = list(outputs) + list(drafts)
    bans = []
    for j in range(rows):
        past = history[:len(outputs) + min(j, len(drafts))]
        bans.append([w[-1] for w in words if len(w) - 1 <= len(past) and past[len(past) - len(w) + 1:] == w[:-1]])
    return bans


def process_logits(logits: torch.Tensor, proc: LogitsProcessing, drafts: torch.Tensor, num_drafts: torch.Tensor,
                   rows_per_request: int) -> torch.Tensor:
    """logits [B * R, V] fp32 -> a processed copy. drafts: [B, K] (K = R - 1) target ids; num_drafts: [B]."""
    r = rows_per_request
    out = logits.clone().view(-1, r, logits.shape[-1])  # [B, R, V]
    sub = out[proc.requests]  # [P, R, V]
    if proc.bias is not None:
        sub = sub + proc.bias[:, None]
    if proc.allowed is not None:
        allowed = proc.allowed  # [P, R', V] rows up to the most drafts held; a wider layout's rows are never read
        if allowed.shape[1] < r:
            allowed = torch.cat([allowed, allowed[:, -1:].expand(-1, r - allowed.shape[1], -1)], dim=1)
        sub = sub.masked_fill(~allowed, float("-inf"))
    if proc.min_tokens_left is not None:
        # Row j emits output number n_out + j, so it is held back while j < min_tokens - n_out.
        early = torch.arange(r, device=logits.device)[None, :] < proc.min_tokens_left[:, None]  # [P, R]
        sub = sub.masked_fill(early[:, :, None] & proc.stop_mask[:, None, :], float("-inf"))
    if proc.output_counts is not None:
        sub = _penalise(sub, proc, _row_counts(proc.output_counts, drafts[proc.requests],
                                               num_drafts[proc.requests], r))
    out[proc.requests] = sub
    return out.view_as(logits)


def _row_counts(counts: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, r: int) -> torch.Tensor:
    """counts [P, V], drafts [P, K], num_drafts [P] -> [P, R, V]: output counts once drafts 0..j-1 are emitted."""
    p, k = drafts.shape
    if k == 0:
        return counts[:, None].expand(p, r, -1)
    real = (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]).float()  # [P, K]
    onehot = torch.zeros(p, k, counts.shape[-1], device=counts.device)
    onehot.scatter_(2, drafts[:, :, None].long(), real[:, :, None])
    before = torch.cat([torch.zeros_like(onehot[:, :1]), onehot.cumsum(1)], dim=1)[:, :r]  # [P, R, V]
    return counts[:, None] + before


def _penalise(logits: torch.Tensor, proc: LogitsProcessing, counts: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits, counts: [P, R, V]."""
    seen = (counts > 0) | proc.prompt_mask[:, None]
    rep = proc.repetition[:, None, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - proc.frequency[:, None, None] * counts
    return logits - proc.presence[:, None, None] * (counts > 0).float()


def token_logprobs(logits: torch.Tensor, requests: torch.Tensor, tokens: torch.Tensor, num_top: int,
                   rows_per_request: int):
    """The target's raw log-probabilities (before any processing, as vLLM reports them) of emitted tokens.

    logits: [B * R, V] unprocessed; requests: [L]; tokens: [B, R] emitted ids (-1 after the next token).
    Returns (chosen [L, R], rank [L, R] (1 = the argmax), top_ids [L, R, num_top], top_logprobs [L, R, num_top]).
    """
    lp = torch.log_softmax(logits.view(-1, rows_per_request, logits.shape[-1])[requests], dim=-1)  # [L, R, V]
    ids = tokens[requests].clamp(min=0).long()
    chosen = lp.gather(2, ids[:, :, None]).squeeze(2)
    rank = (lp > chosen[:, :, None]).sum(-1) + 1
    top_lp, top_ids = lp.topk(num_top, dim=-1) if num_top else (lp[:, :, :0], ids[:, :, None][:, :, :0])
    return chosen, rank, top_ids, top_lp


def target_probs(logits: torch.Tensor, st: SamplingTensors, rows_per_request: int) -> torch.Tensor:
    """logits: [B * R, V] fp32 -> probabilities [B * R, V] (one-hot argmax for greedy rows)."""
    if st.all_greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    temp = st.temperature.repeat_interleave(rows_per_request)[:, None]  # [B*R, 1]
    greedy = temp == 0 if st.any_greedy else None
    scaled = logits / (torch.where(greedy, torch.ones_like(temp), temp) if st.any_greedy else temp)
    if st.needs_filter:
        scaled = _top_k_top_p(scaled, st.top_k.repeat_interleave(rows_per_request),
                              st.top_p.repeat_interleave(rows_per_request))
    probs = torch.softmax(scaled, dim=-1)
    if st.min_p is not None:
        # min_p: drop tokens below min_p times the most likely token's probability, then renormalise.
        floor = st.min_p.repeat_interleave(rows_per_request)[:, None] * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if not st.any_greedy:  # eager steps launch each op from the host: skip the one-hot rows nobody needs
        return probs
    greedy_onehot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, greedy_onehot, probs)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # logits: [N, V]; top_k: [N] (0 = off); top_p: [N] (1 = off)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    before = probs.cumsum(-1) - probs
    drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def exponential_like(probs: torch.Tensor, generators: list[torch.Generator | None], rows_per_request: int):
    """Exp(1) noise [N, V]; rows of a seeded request come from its own generator so its output is reproducible."""
    q = torch.empty_like(probs).exponential_()
    for b, gen in enumerate(generators):
        if gen is not None:
            rows = slice(b * rows_per_request, (b + 1) * rows_per_request)
            q[rows] = torch.empty_like(q[rows]).exponential_(generator=gen)
    return q


_SEEDED_UNIFORMS = 32  # SpeculativeConfig's largest K


def uniform_like(shape, device, generators: list[torch.Generator | None]) -> torch.Tensor:
    """U(0, 1) [B, K]. A seeded request draws the same count every step, whatever K the rest of its batch verifies,
    so its output does not depend on which requests it shares steps with."""
    u = torch.rand(shape, device=device)
    for b, gen in enumerate(generators):
        if gen is not None:
            u[b] = torch.rand(max(_SEEDED_UNIFORMS, shape[1]), device=device, generator=gen)[:shape[1]]
    return u
