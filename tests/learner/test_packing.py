"""Packed rows and shared prompts (fgrpo.learner.packing, fgrpo.learner.forward): the layouts hold every sequence once within the
budget, and each sequence gets the log-probs, loss and gradients of its own unpadded run."""

import copy

import pytest
import torch

from fgrpo.learner.packing import Sequence
from fgrpo.learner.segment_attention import SEGMENT_ATTENTION
from learner_cases import assert_each_sequence_alone, assert_same_update, grouped_seqs, make_seqs, rl_like_seqs, tiny_qwen2, update_grads


def test_pack_rows_first_fit_decreasing():
    from fgrpo.learner.packing import pack_rows

    lengths = [5, 9, 2, 7, 3, 3, 12, 1]
    rows = pack_rows(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert rows[0] == [6]  # longer than a row: a row of its own
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows[1:])
    assert rows == [[6], [1, 7], [3, 4], [0, 5, 2]]  # 12 | 9+1 | 7+3 | 5+3+2: first fit, longest first
    assert rows == pack_rows(lengths, 10)


@pytest.mark.parametrize("seqs", [rl_like_seqs(40), make_seqs(seed=11, count=40)], ids=["rl-like", "even"])
def test_token_budget_micro_batches_hold_every_sequence_once_within_the_budget(seqs):
    from fgrpo.learner.packing import micro_batches

    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    for tokens in (1, 40, 150, 10_000):
        micros = micro_batches(seqs, size=4, tokens=tokens)
        assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)
        for m in micros:
            assert sorted(i for row in m.rows for i in row) == list(range(len(m.seqs)))
            assert m.padded_tokens <= max(tokens, max(lengths))
        if tokens == 10_000:
            assert len(micros) == 1
    # with the budget of 8 longest sequences: about as few padded slots as 8 sorted sequences per micro-batch
    # (the padded layout, best for even lengths; micro-batch boundaries differ), never fewer than the tokens
    padded = micro_batches(seqs, size=8, tokens=None)
    assert [len(m.seqs) for m in padded] == [8] * 5 and all(m.rows is None for m in padded)
    slots = sum(m.padded_tokens for m in micro_batches(seqs, size=8, tokens=8 * max(lengths)))
    assert sum(lengths) <= slots <= 1.05 * sum(m.padded_tokens for m in padded)


@pytest.mark.parametrize("share", [False, True])
def test_one_row_micro_batches_have_no_padding_and_stay_within_the_budget(share):
    """Segment attention: one row per micro-batch, every slot a token, a shared prompt once per micro-batch."""
    from fgrpo.learner.packing import prompt_units, units_length, micro_batches

    seqs = grouped_seqs(prompts=5, samples=8, seed=21)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    groups = [[i for i in range(len(seqs)) if seqs[i].prompt_ids == seqs[k].prompt_ids] for k in range(0, 40, 8)]
    longest = max(units_length(seqs, [g]) for g in groups) if share else max(lengths)
    for tokens in (30, 100, 400, 10_000):
        micros = micro_batches(seqs, size=4, tokens=tokens, share_prompts=share, one_row=True)
        assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)
        for m in micros:
            assert m.rows == [list(range(len(m.seqs)))]
            assert m.padded_tokens == m.real_tokens == units_length(m.seqs, prompt_units(m.seqs, m.rows[0], share))
            # over the budget only as a lone row of the layout, at most as long as the longest sequence or group
            assert m.padded_tokens <= max(tokens, longest)
        unshared = sum(lengths)
        total = sum(m.real_tokens for m in micros)
        assert total == unshared if not share else total < unshared
    # the whole step in one micro-batch: each group's prompt computed once
    (whole,) = micro_batches(seqs, size=4, tokens=10_000, share_prompts=share, one_row=True)
    prompts = {tuple(s.prompt_ids) for s in seqs}
    if share:
        assert whole.real_tokens == sum(len(p) for p in prompts) + sum(len(s.completion_ids) for s in seqs)


def test_token_budget_holds_when_the_longest_sequence_is_over_half_of_it():
    from fgrpo.learner.packing import micro_batches

    lengths = [50, 44, 42, 41, 40, 39, 30, 24, 6]  # rows 1.5 or 2 x 50 wide would not fit 64 slots
    seqs = [Sequence([1] * 4, [2] * (n - 4)) for n in lengths]
    for cost in (0.0, 1e-3):
        micros = micro_batches(seqs, size=4, tokens=64, width_cost=cost)
        assert all(m.padded_tokens <= 64 for m in micros)
        assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)


def test_rl_like_lengths_pack_several_to_a_row():
    from fgrpo.learner.packing import micro_batches

    seqs = rl_like_seqs(64, seed=1)
    real = sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
    padded = sum(m.padded_tokens for m in micro_batches(seqs, size=32, tokens=None))
    micros = micro_batches(seqs, size=32, tokens=32 * 72)
    packed = sum(m.padded_tokens for m in micros)
    assert max(len(row) for m in micros for row in m.rows) >= 3
    assert 1 - real / packed < 0.5 * (1 - real / padded)  # under half the padding


def test_micro_batch_layout_weighs_padding_against_row_width(tiny_model):
    from fgrpo.learner.forward import attention_width_cost
    from fgrpo.learner.packing import micro_batches

    # the tiny Llama: 2 * hidden / parameters of one layer
    layer_params = sum(p.numel() for p in tiny_model.model.layers[0].parameters())
    assert attention_width_cost(tiny_model) == pytest.approx(2 * 32 / layer_params)
    # lengths just over half the longest: rows as wide as the longest hold one each, twice as wide pack two
    seqs = [Sequence([1] * 6, [2] * n) for n in (14, 8, 9, 10, 8, 9, 10, 11, 12, 13)]
    longest = 20

    def widths(cost):
        return {max(sum(len(m.seqs[i].prompt_ids) + len(m.seqs[i].completion_ids) for i in row) for row in m.rows)
                for m in micro_batches(seqs, size=4, tokens=1000, width_cost=cost)}

    assert max(widths(0.0)) > longest  # attention free: the wide rows, least padding
    assert max(widths(1.0)) == longest  # attention dear: one sequence per row
    segments = copy.deepcopy(tiny_model)
    segments.set_attn_implementation(SEGMENT_ATTENTION)
    assert attention_width_cost(segments) == 0.0  # each segment gathers its own keys, whatever the row width


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", SEGMENT_ATTENTION])
def test_packed_rows_give_each_sequence_its_own_logprobs(tiny_model, arch, attention):
    """Sequences sharing a row see only themselves: their log-probs are those of each one run alone."""
    from fgrpo.learner.packing import pack_rows

    model = copy.deepcopy(tiny_model) if arch == "llama" else tiny_qwen2()
    model.set_attn_implementation(attention)
    seqs = make_seqs(seed=12, count=9)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    rows = pack_rows(lengths, 2 * max(lengths))
    assert max(len(row) for row in rows) >= 3
    assert_each_sequence_alone(model, seqs, rows=rows)


@pytest.mark.parametrize("tokens", [12, 150, 1000])
def test_packed_micro_batches_give_the_padded_loss_and_gradients(tiny_model, tokens):
    model, seqs = copy.deepcopy(tiny_model), rl_like_seqs(count=11, seed=13)
    packed = update_grads(model, seqs, micro_batch_tokens=tokens)
    padded = update_grads(model, seqs)
    assert_same_update(packed, padded, loss_atol=1e-6, grad_rel=1e-5)
    assert packed[0]["padding_frac"] < padded[0]["padding_frac"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", SEGMENT_ATTENTION])
def test_shared_prompt_rows_give_each_sequence_its_own_logprobs(tiny_model, arch, attention):
    """A completion behind a shared prompt sees the prompt and itself only: its own sequence's log-probs."""
    from fgrpo.learner.packing import lay_out_rows

    model = copy.deepcopy(tiny_model) if arch == "llama" else tiny_qwen2()
    model.set_attn_implementation(attention)
    seqs = grouped_seqs(prompts=3, samples=4, seed=15)
    # a whole group in a row; a group split over two rows; two groups in one row; a lone sequence with padding
    rows = [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    layout = lay_out_rows(seqs, rows, 0, "cpu", share_prompts=True)
    prompt_lengths = [len(seqs[i].prompt_ids) for i in (0, 4, 6, 8, 10)]
    assert layout.real_tokens == sum(prompt_lengths) + sum(len(s.completion_ids) for s in seqs)
    assert_each_sequence_alone(model, seqs, rows=rows, share_prompts=True)


def test_shared_prompt_layout_masks_every_completion_off_the_others():
    from fgrpo.learner.packing import lay_out_rows

    prompt = [5, 6, 7]
    seqs = [Sequence(prompt, [1, 2]), Sequence(prompt, [3]), Sequence([9], [4])]
    layout = lay_out_rows(seqs, [[0, 1, 2]], 0, "cpu", share_prompts=True)
    # row: 5 6 7 | 1 2 | 3 | 9 4, positions continue from the prompt for each completion
    assert layout.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 9, 4]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    assert layout.predict_at.tolist() == [2, 3, 2, 6]  # the prompt's last token predicts both first tokens
    allowed = layout.allowed[0, 0].int().tolist()
    assert allowed[5] == [1, 1, 1, 0, 0, 1, 0, 0]  # completion 2 sees the prompt and itself, not completion 1
    assert allowed[4] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert allowed[7] == [0, 0, 0, 0, 0, 0, 1, 1]  # the other prompt's sequence sees only itself
    assert lay_out_rows(seqs, [[0, 1, 2]], 0, "cpu").allowed is None  # not shared: the positions' packed mask


@pytest.mark.parametrize("tokens", [30, 200, 1000])
def test_shared_prompt_micro_batches_give_the_padded_loss_and_gradients(tiny_model, tokens):
    from fgrpo.learner.packing import micro_batches

    model, seqs = copy.deepcopy(tiny_model), grouped_seqs(prompts=4, samples=8, seed=16)
    shared = update_grads(model, seqs, micro_batch_tokens=tokens, share_prompts=True)
    assert_same_update(shared, update_grads(model, seqs), loss_atol=1e-6, grad_rel=1e-5)
    packed = update_grads(model, seqs, micro_batch_tokens=tokens)
    assert shared[0]["computed_tokens"] < packed[0]["computed_tokens"] == sum(
        len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
    micros = micro_batches(seqs, size=4, tokens=tokens, share_prompts=True)
    assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)
    longest_group = max(sum(len(s.completion_ids) for s in seqs[k : k + 8]) + len(seqs[k].prompt_ids)
                        for k in range(0, 32, 8))
    assert all(m.share_prompts and m.padded_tokens <= max(tokens, longest_group) for m in micros)


def test_shared_prompts_need_packed_rows_and_a_mask_taking_attention(tiny_model, compose):
    from fgrpo.validation import validate
    from fgrpo.infra.errors import ConfigError
    from fgrpo.learner.forward import _attention_mask

    validate(compose("hardware=cpu", "hardware.share_prompts=true"))
    cfg = compose("hardware=cpu", "hardware.share_prompts=true", "hardware.micro_batch_tokens=null")
    with pytest.raises(ConfigError, match="hardware.micro_batch_tokens"):
        validate(cfg)
    model = copy.deepcopy(tiny_model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="hardware.attention=segments"):
        _attention_mask(model, torch.ones(1, 1, 2, 2, dtype=torch.bool))
