"""What the model-family tests share: peagle's logits and aux hidden states for a token sequence, transformers' for
the same, and their comparison over random sequences of a few lengths (fp32)."""

from __future__ import annotations

import torch

from peagle.models.attention import DenseAttention

ATOL = 1e-4


def logits_and_aux(model, ids, aux_ids):
    out = model(ids, torch.arange(ids.numel()), DenseAttention(), aux_layer_ids=aux_ids)
    return model.compute_logits(out.hidden), out.aux


def hf_logits_and_aux(hf, ids, aux_ids):
    """transformers' logits and the hidden states `aux_ids` index, concatenated (what `logits_and_aux` gives)."""
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i][0] for i in aux_ids], dim=-1)


def check_against_transformers(model, hf, aux_ids, lengths=(1, 5, 29), vocab_size=None):
    """Random token sequences of `lengths` (seeded 3, ids below `vocab_size`, the model's vocabulary by default):
    peagle's logits and aux states equal transformers' within ATOL. Returns the last sequence's logits."""
    gen = torch.Generator().manual_seed(3)
    for length in lengths:
        ids = torch.randint(0, vocab_size or model.config.vocab_size, (length,), generator=gen)
        logits, aux = logits_and_aux(model, ids, aux_ids)
        ref_logits, ref_aux = hf_logits_and_aux(hf, ids, aux_ids)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(aux, ref_aux, atol=ATOL, rtol=1e-4)
    return logits
