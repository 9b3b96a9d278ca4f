"""fgrpo.rewards.binding: a reward function's parameters filled by name, in fgrpo's, verl's and TRL's conventions."""

import functools

import pytest

from fgrpo.rewards.binding import arguments, batch_arguments, bind, sample_view, unfilled

ROW = {"question": "What is 2 + 3?", "answer": 5, "solution": "5", "level": 2}


def view(**changes):
    values = dict(completion="It is 5", completion_ids=[7, 8], prompt="What is 2 + 3? Answer.", answer="5",
                  source="arith", fields=ROW, timeout_s=5.0)
    values.update(changes)
    return sample_view(**values)


def test_the_view_holds_fgrpos_names_and_every_column():
    got = view()
    assert got["completion"] == got["solution_str"] == "It is 5"
    assert got["answer"] == got["ground_truth"] == "5"  # the reference as text, even where the column holds 5
    assert got["completion_ids"] == [7, 8] and got["timeout_s"] == 5.0
    assert got["data_source"] == "arith" and got["extra_info"] == ROW  # no such columns: the source, every column
    assert got["solution"] == "5" and got["level"] == 2 and got["question"] == ROW["question"]


def test_verls_own_columns_win_for_data_source_and_extra_info():
    verl_row = {"data_source": "openai/gsm8k", "extra_info": {"index": 3, "split": "train"},
                "reward_model": {"ground_truth": "72", "style": "rule"}, "prompt": [{"role": "user", "content": "q"}]}
    got = view(fields=verl_row, answer="72")
    assert got["data_source"] == "openai/gsm8k" and got["extra_info"] == {"index": 3, "split": "train"}
    assert got["prompt"] == "What is 2 + 3? Answer."  # fgrpo's name wins over a column of the same name
    assert got["reward_model"]["style"] == "rule"


def fgrpo_style(completion, answer):
    return float(answer in completion)


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def trl_style(prompts, completions, completion_ids, solution, **kwargs):
    return [1.0] * len(completions)


def with_kwargs(completion, **kwargs):
    return 0.0


def test_binding_reads_the_signature():
    assert bind(fgrpo_style).params == ("completion", "answer") and not bind(fgrpo_style).batch
    verl = bind(verl_style)
    assert verl.with_defaults == {"extra_info"} and not verl.batch and not verl.takes_kwargs
    trl = bind(trl_style)
    assert trl.batch and trl.takes_kwargs and trl.params == ("prompts", "completions", "completion_ids", "solution")
    assert bind(functools.partial(verl_style, "x")).params == ("solution_str", "ground_truth", "extra_info")
    assert bind(lambda completion, /: 0).positional_only == ("completion",)


def test_arguments_by_name_and_the_rest_to_kwargs():
    assert arguments(bind(fgrpo_style), view()) == {"completion": "It is 5", "answer": "5"}
    verl = arguments(bind(verl_style), view())
    assert verl == {"data_source": "arith", "solution_str": "It is 5", "ground_truth": "5", "extra_info": ROW}
    rest = arguments(bind(with_kwargs), view())
    assert rest["completion"] == "It is 5" and {"answer", "solution", "level", "completion_ids"} <= set(rest)

    def keeps_default(completion, style="strict"):
        return 0.0

    assert arguments(bind(keeps_default), view()) == {"completion": "It is 5"}  # nothing named style: the default


def test_unfilled_parameters_are_named():
    def needs(completion, target, mode="x"):
        return 0.0

    assert unfilled(bind(needs), set(ROW)) == ["target"]
    assert unfilled(bind(needs), set(ROW) | {"target"}) == []
    assert unfilled(bind(trl_style), {"solution"}) == []
    assert unfilled(bind(trl_style), set()) == ["solution"]
    assert unfilled(bind(lambda completion, /: 0), set()) == ["completion (positional-only)"]


@pytest.mark.parametrize("conversational", [False, True])
def test_a_batch_function_gets_lists_and_trls_chat_form(conversational):
    views = [view(completion="5", completion_ids=[1]), view(completion="6", completion_ids=[2, 3])]
    got = batch_arguments(bind(trl_style), views, conversational=conversational, system_prompt="Be brief.")
    assert got["completion_ids"] == [[1], [2, 3]] and got["solution"] == ["5", "5"]
    if conversational:
        assert got["completions"] == [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]]
        assert got["prompts"][0] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "What is 2 + 3? Answer."}]
    else:
        assert got["completions"] == ["5", "6"] and got["prompts"] == ["What is 2 + 3? Answer."] * 2
    assert got["answer"] == ["5", "5"]  # **kwargs: every name as a list
