"""The verifier is lossless: greedy equals argmax decoding, and speculative sampling keeps the target distribution."""

import dataclasses

import pytest
import torch

from peagle.engine.sampler import SamplingTensors, target_probs
from peagle.engine.spec.verifier import verify_greedy, verify_sampled, verify_synthetic

CHI2_CRIT_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
                  11: 31.26}  # chi-square critical values at p = 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of zero target probability was emitted"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def test_greedy_accepts_matching_prefix_then_emits_target_token():
    argmax = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[5, 6, 0], [1, 2, 3], [9, 9, 9]])
    out = verify_greedy(argmax, drafts, torch.tensor([3, 3, 1]))
    assert out.num_accepted.tolist() == [2, 3, 1]
    assert out.next_tokens.tolist() == [7, 4, 9]
    assert out.output_tokens.tolist() == [[5, 6, 7, -1], [1, 2, 3, 4], [9, 9, -1, -1]]


def test_pad_drafts_are_fed_but_never_accepted():
    # A step whose K rose is laid out for more drafts than it has; its pads (id < 0) end acceptance like the end of
    # the drafts would: the same answers as verifying the real drafts alone, greedy, sampled and synthetic.
    torch.manual_seed(0)
    b, v = 64, 5
    probs = torch.softmax(torch.randn(b, 4, v), dim=-1)
    real = probs[:, :2].argmax(-1)  # two real drafts the target agrees with, then a pad
    padded = torch.cat([real, torch.full((b, 1), -1)], dim=1)
    nd = torch.full((b,), 3)
    g = verify_greedy(probs.argmax(-1), padded, nd)
    ref = verify_greedy(probs[:, :3].argmax(-1), real, torch.full((b,), 2))
    assert g.num_accepted.tolist() == ref.num_accepted.tolist() == [2] * b
    assert g.next_tokens.tolist() == ref.next_tokens.tolist()
    u = torch.rand(b, 3)
    noise = torch.empty(b, v).exponential_()
    s = verify_sampled(probs, padded, nd, u, noise)
    ref = verify_sampled(probs[:, :3], real, torch.full((b,), 2), u[:, :2], noise)
    assert s.num_accepted.tolist() == ref.num_accepted.tolist()
    assert s.next_tokens.tolist() == ref.next_tokens.tolist()  # a bonus after the real drafts, from the plain distribution
    assert (s.num_accepted == 2).any() and (s.num_accepted < 2).any()
    y = verify_synthetic(probs.argmax(-1), padded, nd, (1.0, 1.0, 1.0))
    assert y.num_accepted.tolist() == [2] * b


def _sample_many(p_rows: torch.Tensor, drafts: torch.Tensor, n: int, seed: int):
    """Run the verifier n times (vectorised) on fixed target rows [K+1, V] and drafts [K]."""
    g = torch.Generator().manual_seed(seed)
    k = drafts.shape[0]
    probs = p_rows[None].expand(n, -1, -1)
    u = torch.rand(n, k, generator=g)
    noise = torch.empty(n, p_rows.shape[1]).exponential_(generator=g)
    return verify_sampled(probs, drafts[None].expand(n, -1), torch.full((n,), k), u, noise)


@pytest.mark.parametrize("draft_choice", ["argmax", "unlikely", "impossible"])
def test_first_token_follows_target_distribution(draft_choice):
    torch.manual_seed(0)
    v = 6
    p = torch.softmax(torch.randn(3, v) * 1.5, dim=-1)
    p[0, 4] = 0.0
    p = p / p.sum(-1, keepdim=True)
    d0 = {"argmax": int(p[0].argmax()), "unlikely": int(p[0].argmin()), "impossible": 4}[draft_choice]
    drafts = torch.tensor([d0, int(p[1].argmax())])
    out = _sample_many(p, drafts, 200_000, seed=1)
    first = out.output_tokens[:, 0]
    stat, dof = chi_square(torch.bincount(first, minlength=v).float(), p[0])
    assert stat < CHI2_CRIT_P001[dof], (stat, dof)
    # Given the first draft was accepted, the second token follows the target's next distribution.
    second = out.output_tokens[first == d0, 1]
    if second.numel() > 5000:
        stat, dof = chi_square(torch.bincount(second, minlength=v).float(), p[1])
        assert stat < CHI2_CRIT_P001[dof], (stat, dof)


def test_bonus_token_after_all_accepted_follows_last_distribution():
    torch.manual_seed(1)
    v = 6
    p = torch.softmax(torch.randn(2, v), dim=-1)
    p[0] = torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])
    out = _sample_many(p, torch.tensor([0]), 200_000, seed=2)
    bonus = out.output_tokens[out.num_accepted == 1, 1]
    stat, dof = chi_square(torch.bincount(bonus, minlength=v).float(), p[1])
    assert stat < CHI2_CRIT_P001[dof], (stat, dof)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.6), (0.9, 8, 0.8)])
def test_filtered_target_distribution_is_kept(temperature, top_k, top_p):
    torch.manual_seed(2)
    v = 12
    logits = torch.randn(2, v) * 2
    st = SamplingTensors(torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), False,
                         top_k > 0 or top_p < 1, [None])
    p = target_probs(logits, st, rows_per_request=2)
    # A batch with no greedy request skips the one-hot rows and gets the same distributions.
    torch.testing.assert_close(target_probs(logits, dataclasses.replace(st, any_greedy=False), 2), p, atol=0, rtol=0)
    # The reference filter, written plainly.
    ref = torch.softmax(logits[0] / temperature, -1)
    order = ref.argsort(descending=True)
    keep = torch.zeros(v, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[t] = True
        mass += ref[t].item()
    ref = torch.where(keep, ref, 0.0)
    ref = ref / ref.sum()
    torch.testing.assert_close(p[0], ref, atol=1e-6, rtol=1e-5)
    out = _sample_many(p, torch.tensor([int(p[0].argmax())]), 200_000, seed=3)
    counts = torch.bincount(out.output_tokens[:, 0], minlength=v).float()
    stat, dof = chi_square(counts, p[0])
    assert stat < CHI2_CRIT_P001[dof], (stat, dof)


def test_sampling_tensors_say_whether_any_request_is_greedy():
    from types import SimpleNamespace

    from peagle import SamplingParams
    from peagle.engine.sampler import build_sampling_tensors

    def seqs(*temperatures):
        return [SimpleNamespace(sampling_params=SamplingParams(temperature=t, max_tokens=4), draft_token_ids=[])
                for t in temperatures]

    cpu = torch.device("cpu")
    assert not build_sampling_tensors(seqs(0.7, 1.0), [None, None], 50, cpu).any_greedy
    mixed = build_sampling_tensors(seqs(0.0, 1.0), [None, None], 50, cpu)
    assert mixed.any_greedy and not mixed.all_greedy and mixed.temperature.tolist() == [0.0, 1.0]


def test_greedy_rows_in_a_sampling_batch_stay_argmax():
    logits = torch.randn(4, 50)
    st = SamplingTensors(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]), False, False,
                         [None, None])
    p = target_probs(logits, st, rows_per_request=2)
    assert torch.equal(p[:2].argmax(-1), logits[:2].argmax(-1))
    assert torch.equal(p[:2].max(-1).values, torch.ones(2))
