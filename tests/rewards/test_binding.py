"""fgrpo.rewards.binding: a reward function's parameters filled by name, in fgrpo's, verl's and TRL's conventions."""

import functools

import pytest

from fgrpo.rewards.binding import (TrainerState, arguments, batch_arguments, bind, needed, sample_view, unfilled,
                                   unknown_kwargs)

ROW = {"question": "What is 2 + 3?", "answer": 5, "solution": "5", "level": 2}


def view(**changes):
    values = dict(completion="It is 5", completion_ids=[7, 8], prompt="What is 2 + 3? Answer.", answer="5",
                  source="arith", fields=ROW, timeout_s=5.0)
    values.update(changes)
    return sample_view(**values)


def test_the_view_holds_fgrpos_names_and_every_column():
    got = view()
    assert got["completion"] == got["solution_str"] == "It is 5"
    assert got["answer"] == got["ground_truth"] == "5"  # no reference given: the text (the row's own: test below)
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


def only_completions(completions):
    return [1.0] * len(completions)


def only_prompts(prompts):
    return [1.0] * len(prompts)


def both(prompts, completions):
    return [1.0] * len(completions)


def completions_kwargs(completions, **kwargs):
    return [1.0] * len(completions)


def prompts_kwargs(prompts, **kwargs):
    return [1.0] * len(prompts)


def both_kwargs(prompts, completions, **kwargs):
    return [1.0] * len(completions)


@pytest.mark.parametrize("fn", [only_completions, only_prompts, both, completions_kwargs, prompts_kwargs, both_kwargs])
@pytest.mark.parametrize("conversational", [False, True])
def test_every_combination_of_trls_names_gets_exactly_its_parameters(fn, conversational):
    """What a worker is sent (``needed``) is all a call may read: a function taking completions alone gets no prompts
    (this was a KeyError on every sample of a chat model)."""
    binding = bind(fn)
    sent = [needed(binding, view(completion="5")), needed(binding, view(completion="6"))]
    got = batch_arguments(binding, sent, conversational=conversational, system_prompt="Be brief.")
    assert fn(**got) == [1.0, 1.0]
    if "completions" in binding.params:
        assert got["completions"] == ([[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]]
                                      if conversational else ["5", "6"])
    if "prompts" in binding.params:
        user = "What is 2 + 3? Answer."
        assert got["prompts"] == ([[{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]] * 2
                                  if conversational else [user] * 2)
    if not binding.takes_kwargs:
        assert set(got) == set(binding.params)


def test_verls_batch_names_and_an_entrys_kwargs():
    def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        return [scale * (gt in s) for s, gt in zip(solution_strs, ground_truths)]

    binding = bind(verl_batch)
    assert binding.batch and unfilled(binding, set()) == []
    sent = [needed(binding, view(completion="It is 5")), needed(binding, view(completion="no"))]
    got = batch_arguments(binding, sent, conversational=True, per_call={"scale": 2.0})
    assert got["data_sources"] == ["arith", "arith"] and got["extra_infos"] == [ROW, ROW]
    assert verl_batch(**got) == [2.0, 0.0]
    assert unknown_kwargs(bind(fgrpo_style), {"scale": 2}) == ["scale"] and unknown_kwargs(binding, {"scale": 2}) == []
    assert unfilled(bind(lambda completion, mode: 0), set(), {"mode": "strict"}) == []


@pytest.mark.parametrize("reference", [{"target": [3, 4]}, [1, 2], 7, "seven"])
def test_verls_ground_truth_arrives_as_the_row_holds_it(reference):
    got = view(reference=reference, answer=None if isinstance(reference, (dict, list)) else str(reference))
    assert got["ground_truth"] == reference and type(got["ground_truth"]) is type(reference)
    assert got["row"] == ROW  # every column as it is: a column named 'answer' stays reachable as row["answer"]
    assert got["row"]["answer"] == 5


def test_trls_per_call_names_are_passed_to_whoever_asks():
    def curriculum(completion, trainer_state, log_metric):
        return 0.0

    binding = bind(curriculum)
    assert unfilled(binding, set()) == [] and binding.wants("trainer_state") and not bind(fgrpo_style).wants("log_metric")
    state = TrainerState(3, 10, 0.5)
    got = arguments(binding, view(), {"trainer_state": state, "log_metric": print})
    assert got["trainer_state"].global_step == 3 and got["log_metric"] is print
