"""A sampled step's per-request tensors reach the GPU without synchronising the stream (a pageable copy would hold the
host behind the step in flight and undo async scheduling's overlap): checked with torch's sync debug mode, which
raises on a synchronising call, over temperature, top-k/top-p, min_p, penalties, logit_bias and logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peagle import SamplingParams
from peagle.engine.sampler import build_sampling_tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 4096


def seq(params: SamplingParams, outputs=(5, 9, 9)):
    prompt = [1, 2, 3]
    return SimpleNamespace(sampling_params=params, draft_token_ids=[7, 8], output_token_ids=list(outputs),
                           token_ids=prompt + list(outputs), num_prompt_tokens=len(prompt),
                           num_output_tokens=len(outputs), eos_token_ids=[0])


def test_sampling_tensors_upload_without_a_stream_sync():
    device = torch.device("cuda")
    seqs = [seq(SamplingParams(temperature=0.7, max_tokens=8)),
            seq(SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)),
            seq(SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                               frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={3: 2.0}, max_tokens=8))]
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(8):  # keep the stream busy, so a synchronising copy would have something to wait for
        busy = busy @ busy / 64
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = build_sampling_tensors(seqs, [None] * len(seqs), VOCAB, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert st.temperature.tolist() == pytest.approx([0.7, 0.0, 1.0])
    assert st.top_k.dtype == torch.long and st.top_k.tolist() == [0, 0, 50]
    assert st.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9]) and st.min_p.tolist() == pytest.approx([0, 0, 0.05])
    assert st.needs_filter and not st.all_greedy and st.num_logprobs == 2 and st.logprob_requests.tolist() == [1]
    proc = st.processing
    assert proc.requests.tolist() == [2] and proc.bias[0, 3].item() == 2.0
    assert proc.output_counts[0, 9].item() == 2.0 and proc.prompt_mask[0, 2].item()
    # The check can fail: the plain way of making such a tensor synchronises.
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.tensor([0.7, 0.0, 1.0], device=device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
