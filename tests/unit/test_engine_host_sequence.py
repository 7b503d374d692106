import pytest

from peagle.engine.sampling_params import SamplingParams
from peagle.engine.sequence import Sequence, SequenceStatus

EOS = 2


def make_seq(prompt=(10, 11, 12), eos=frozenset({EOS}), max_model_len=None, **params):
    return Sequence("r", list(prompt), SamplingParams(**params), arrival_time=0.0, eos_token_ids=eos,
                    max_model_len=max_model_len)


def test_fresh_sequence():
    seq = make_seq()
    assert seq.status is SequenceStatus.WAITING
    assert seq.num_tokens == 3 and seq.num_prompt_tokens == 3 and seq.output_token_ids == []
    assert seq.num_new_tokens == 3 and seq.finish_reason is None


def test_eos_inside_an_accepted_run_truncates():
    seq = make_seq(max_tokens=10)
    assert seq.append_tokens([5, EOS, 6, 7], now=1.0) == 2
    assert seq.output_token_ids == [5, EOS]
    assert seq.is_finished and seq.finish_reason == "stop"


def test_ignore_eos_keeps_going():
    seq = make_seq(max_tokens=10, ignore_eos=True)
    assert seq.append_tokens([5, EOS, 6]) == 3
    assert not seq.is_finished and seq.output_token_ids == [5, EOS, 6]


def test_stop_token_ids_stop_even_with_ignore_eos():
    seq = make_seq(max_tokens=10, ignore_eos=True, stop_token_ids=[6])
    assert seq.append_tokens([5, EOS, 6, 7]) == 3
    assert seq.finish_reason == "stop" and seq.output_token_ids == [5, EOS, 6]


def test_max_tokens_inside_a_run():
    seq = make_seq(max_tokens=3)
    assert seq.append_tokens([5]) == 1
    assert seq.append_tokens([6, 7, 8, 9]) == 2
    assert seq.finish_reason == "length" and seq.output_token_ids == [5, 6, 7]


def test_eos_on_the_last_allowed_token_is_a_stop():
    seq = make_seq(max_tokens=2)
    assert seq.append_tokens([5, EOS]) == 2
    assert seq.finish_reason == "stop"


def test_max_model_len_caps_total_length():
    seq = make_seq(max_tokens=100, max_model_len=5)
    assert seq.append_tokens([5, 6, 7]) == 2
    assert seq.finish_reason == "length" and seq.num_tokens == 5


def test_append_to_finished_sequence_is_a_bug():
    seq = make_seq(max_tokens=1)
    seq.append_tokens([5])
    with pytest.raises(AssertionError):
        seq.append_tokens([6])


def test_commit_prefill_then_verify_rounds():
    seq = make_seq(max_tokens=50)
    seq.commit([20], now=1.0)  # prefill: prompt computed, the sampled token is not
    assert seq.num_computed_tokens == 3 and seq.num_tokens == 4 and seq.num_new_tokens == 1
    assert seq.first_token_time == 1.0 and seq.num_drafting_rounds == 0

    seq.draft_token_ids = [21, 22, 23]
    assert seq.num_new_tokens == 4  # last token + 3 drafts
    assert seq.commit([21, 22, 30], now=2.0) == 3  # two drafts accepted, then a recovered token
    assert seq.draft_token_ids == []
    assert seq.output_token_ids == [20, 21, 22, 30]
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 6
    assert (seq.num_drafting_rounds, seq.num_draft_tokens, seq.num_accepted_tokens) == (1, 3, 2)
    assert seq.accepted_per_position == [1, 1, 0]

    seq.draft_token_ids = [31, 32, 33, 34]  # K may grow between rounds
    seq.commit([31, 32, 33, 34, 35], now=3.5)  # all accepted plus the bonus token
    assert seq.accepted_per_position == [2, 2, 1, 1]
    assert seq.num_accepted_tokens == 6 and seq.last_token_time == 3.5 and seq.first_token_time == 1.0


def test_drafts_past_the_confidence_cutoff_are_proposed_not_verified():
    seq = make_seq(max_tokens=50)
    seq.commit([20])
    seq.set_drafts([21, 22, -1, -1])  # two confident drafts, two past the cutoff (PAD_DRAFT)
    assert seq.draft_token_ids == [21, 22] and seq.num_new_tokens == 3
    seq.commit([21, 30], num_verified=2)
    assert (seq.num_draft_tokens, seq.num_verified_tokens, seq.num_accepted_tokens) == (4, 2, 1)
    assert seq.accepted_per_position == [1, 0, 0, 0]
    seq.set_drafts([31, 32, 33])
    seq.commit([31, 40], num_verified=1)  # a step launched ahead verified only the first (its rows ran out)
    assert (seq.num_draft_tokens, seq.num_verified_tokens, seq.num_accepted_tokens) == (7, 3, 2)
    seq.set_drafts([-1, -1])
    seq.commit([41], num_verified=0)  # nothing confident: a plain step, still a drafting round
    assert (seq.num_drafting_rounds, seq.num_verified_tokens) == (3, 3)
    seq.set_drafts([51, 52])
    with pytest.raises(AssertionError):
        seq.commit([51, 52, 60], num_verified=1)  # more accepted than verified


def test_commit_counts_acceptance_before_stop_truncation():
    seq = make_seq(max_tokens=50)
    seq.commit([20])
    seq.draft_token_ids = [21, EOS, 23]
    assert seq.commit([21, EOS, 23, 24]) == 2
    assert seq.finish_reason == "stop" and seq.num_accepted_tokens == 3


def test_commit_rejects_tokens_that_are_not_the_drafts():
    seq = make_seq()
    seq.commit([20])
    seq.draft_token_ids = [21, 22]
    with pytest.raises(AssertionError):
        seq.commit([21, 99, 5])
    with pytest.raises(AssertionError):
        seq.commit([21, 22, 5, 6])


def test_reset_for_recompute():
    seq = make_seq()
    seq.commit([20])
    seq.draft_token_ids = [1, 2]
    seq.status = SequenceStatus.RUNNING
    seq.reset_for_recompute()
    assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0 and seq.draft_token_ids == []
    assert seq.num_new_tokens == seq.num_tokens == 4
