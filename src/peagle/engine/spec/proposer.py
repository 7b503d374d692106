"""Proposers: turn the verified target batch into the next K drafts per request.

EAGLE-3 and P-EAGLE share the first step, the fused expansion of the verified batch into the draft batch
(`peagle.kernels.expand_draft_batch`). P-EAGLE appends K-1 MASK slots per request and drafts all K tokens in that
one pass; EAGLE-3 drafts one token from it, then chains K-1 single-token passes on its own hidden state.

With a confidence `cutoff` (spec/confidence.py) each request's drafts past its confident prefix come back as
PAD_DRAFT. EAGLE-3 then also stops chaining once no request of the batch is confident any more, where it may look
(an eager pass; a CUDA graph runs its whole chain).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from peagle import kernels
from peagle.engine.attention import AttentionMetadata, AttentionOptions, PagedAttention
from peagle.engine.spec.confidence import PAD_DRAFT, confidence, draft_probability, truncate_drafts


@dataclass
class DraftInputs:
    """The verified target batch, as the proposer sees it. All tensors live on the device."""

    input_ids: torch.Tensor  # [T] target input ids of the step
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    aux: torch.Tensor  # [T, 3 * d_target] target features
    num_rejected: torch.Tensor  # [B] trailing target rows that are not valid
    next_tokens: torch.Tensor  # [B] the token sampled after the last valid row
    max_query_len: int
    small_query_len: int | None = None  # a mixed step's most target rows of a decoding request (AttentionMetadata)


class Proposer(ABC):
    """Drafts K tokens per request with a drafter that owns a paged KV cache of its own (K: the engine's, or fewer
    where the adaptive policy verifies fewer)."""

    def __init__(self, drafter, kv_caches, block_size: int, k: int, *, attention: AttentionOptions):
        self.drafter = drafter
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.k = k
        self.attention = attention
        cfg = drafter.config.transformer_layer_config
        self.scale = cfg.head_dim ** -0.5

    @abstractmethod
    def propose(self, inp: DraftInputs, k: int | None = None,
                cutoff: torch.Tensor | None = None) -> torch.Tensor:  # [B, k] target ids (k: self.k)
        """`cutoff` (a device scalar): drafts past each request's confident prefix come back as PAD_DRAFT."""

    def _first_pass(self, inp: DraftInputs, num_mask_slots: int, mask_hidden: torch.Tensor | None):
        e = kernels.expand_draft_batch(
            inp.input_ids, inp.positions, inp.slot_mapping, inp.query_start_loc, inp.num_rejected,
            inp.next_tokens, inp.block_tables, self.block_size, self.mask_token_id, num_mask_slots,
        )
        if mask_hidden is None:  # no MASK rows: every row's feature is a target row
            features = inp.aux.index_select(0, e.hidden_index.clamp(min=0))  # [R, 3 * d_target]
        else:
            features = kernels.gather_draft_features(inp.aux, e.hidden_index, mask_hidden)
        small = None if inp.small_query_len is None else inp.small_query_len + num_mask_slots
        meta = AttentionMetadata(e.positions, e.slot_mapping, inp.block_tables, e.query_start_loc,
                                 inp.max_query_len + num_mask_slots, small)
        attention = PagedAttention(self.kv_caches, meta, self.scale, self.attention)
        hidden = self.drafter(e.input_ids, e.positions, attention, self.drafter.fc(features))  # [R, d]
        return e, hidden

    def _tokens(self, hidden: torch.Tensor, probs: bool = False):
        """Target ids of the drafter's argmax at each row [N]; with `probs`, also its probability there [N]."""
        logits = self.drafter.compute_logits(hidden)  # [N, draft_vocab] fp32
        tokens = self.drafter.to_target_ids(logits.argmax(dim=-1))
        return (tokens, draft_probability(logits)) if probs else tokens

    @property
    def mask_token_id(self) -> int:
        return self.drafter.config.mask_token_id if self.drafter.config.mask_token_id is not None else 0


class ParallelDraftingProposer(Proposer):
    """P-EAGLE: [shifted tokens..., next token, MASK x (K-1)] in ONE drafter pass."""

    def propose(self, inp: DraftInputs, k: int | None = None, cutoff: torch.Tensor | None = None) -> torch.Tensor:
        k = self.k if k is None else k
        e, hidden = self._first_pass(inp, k - 1, self.drafter.mask_hidden)
        b = e.sample_rows.shape[0]
        rows = hidden[e.sample_rows.reshape(-1)]  # [B * k, d]
        if cutoff is None:
            return self._tokens(rows).view(b, k)
        tokens, probs = self._tokens(rows, probs=True)
        return truncate_drafts(tokens.view(b, k), probs.view(b, k), cutoff)


class Eagle3Proposer(Proposer):
    """EAGLE-3: one pass over the verified rows, then K-1 chained passes fed the drafter's own argmax and hidden."""

    def propose(self, inp: DraftInputs, k: int | None = None, cutoff: torch.Tensor | None = None) -> torch.Tensor:
        k = self.k if k is None else k
        e, hidden = self._first_pass(inp, 0, None)
        rows = e.sample_rows[:, 0]
        h = hidden[rows]  # [B, d]
        probs = []  # [B] per pass, with a cutoff
        token = self._draft(h, cutoff, probs)
        drafts = [token]
        b = rows.shape[0]
        live = inp.query_start_loc[1:] > inp.query_start_loc[:-1]  # padding requests write nothing
        pos = e.positions[rows]
        qsl = torch.arange(b + 1, device=pos.device, dtype=inp.query_start_loc.dtype)
        for _ in range(k - 1):
            if cutoff is not None and self._all_below(probs, cutoff, live):
                break  # no request verifies a draft from here on: the rest are PAD_DRAFT
            pos = pos + 1
            block = inp.block_tables.gather(1, (pos // self.block_size).clamp(max=inp.block_tables.shape[1] - 1)
                                            .long()[:, None]).squeeze(1)
            slots = torch.where(live, block.long() * self.block_size + pos % self.block_size,
                                torch.full_like(pos, -1, dtype=torch.long))
            meta = AttentionMetadata(pos, slots, inp.block_tables, qsl, 1)
            h = self.drafter(token, pos, PagedAttention(self.kv_caches, meta, self.scale, self.attention), h)
            token = self._draft(h, cutoff, probs)
            drafts.append(token)
        out = torch.stack(drafts, dim=1)  # [B, passes]
        if cutoff is None:
            return out
        missing = k - out.shape[1]
        out = torch.cat([out, out.new_full((b, missing), PAD_DRAFT)], dim=1)
        p = torch.stack(probs, dim=1)
        return truncate_drafts(out, torch.cat([p, p.new_zeros(b, missing)], dim=1), cutoff)

    def _draft(self, h: torch.Tensor, cutoff: torch.Tensor | None, probs: list) -> torch.Tensor:
        """One pass's drafts [B] from its hidden states; with a cutoff their probabilities go to `probs`."""
        if cutoff is None:
            return self._tokens(h)
        token, p = self._tokens(h, probs=True)
        probs.append(p)
        return token

    @staticmethod
    def _all_below(probs: list, cutoff: torch.Tensor, live: torch.Tensor) -> bool:
        """Whether no real request's confidence is at or above the cutoff any more, so further passes verify
        nothing. Read on the host, which waits for the device: only where no CUDA graph is being captured (a
        graph's chain keeps its length; its drafts past the cutoff are still padded)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        last = confidence(torch.stack(probs, dim=1))[:, -1]
        return not bool(((last >= cutoff) & live).any())
