"""Episodes end to end below the loop (fgrpo.rollout.episodes.sample_episodes): the real worker pool, and a real
sampler (transformers' on tiny_random) or, where a test needs the model to write an exact tool call or answer, a
scripted one that encodes its texts as a model's tokens. Token in, token out: every later turn is sampled from the
ids sampled before, never from their text encoded again; the loss mask; the token budget; tool calls malformed,
unknown or wrong counted and shown to the model; a class failing every episode of the first batch stops the run."""

from pathlib import Path

import pytest
import torch

from fgrpo.environments.chat import Renderer
from fgrpo.environments.spec import describe
from fgrpo.infra.errors import RewardError
from fgrpo.rewards.entries import reward_entries
from fgrpo.rewards.scoring import Scorer
from fgrpo.rollout.data import arithmetic_problems, with_prompts
from fgrpo.rollout.episodes import Environment, episode_metrics, sample_episodes
from fgrpo.rollout.rollouts import overlong_penalties
from fgrpo.rollout.samplers import Completion

ENVS = Path(__file__).with_name("envs.py")


@pytest.fixture(scope="module")
def tokenizer(compose):
    from fgrpo.learner.model import load_tokenizer, resolve_model_folder

    return load_tokenizer(resolve_model_folder(compose("model=tiny_random").model))


@pytest.fixture(scope="module")
def scorer():
    with_pool = Scorer([], workers=2, warm_up_also=None)
    from fgrpo.user_code.pool import WorkerPool
    from fgrpo.user_code.running import run_request

    with_pool.pool = WorkerPool(run_request, 2, timeout_s=5.0, seed=0)
    yield with_pool
    with_pool.close()


def problems(count=2):
    train, _ = arithmetic_problems(ops=("+",), max_operand=9, seed=0, n_eval=1)
    return with_prompts(train[:count], "")


def environment(name: str, tokenizer, **limits) -> Environment:
    spec = describe(f"{ENVS}:{name}")
    settings = dict(max_turns=3, max_tokens=200, timeout_s=5.0)
    settings.update(limits)
    return Environment(spec, Renderer(tokenizer, chat=True, tools=spec.tools), **settings)


class Scripted:
    """A sampler whose model writes ``reply(context text, turn)`` as tokens (EOS after), recording each context."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.contexts = tokenizer, reply, []

    def generate(self, prompts, n, *, max_new_tokens, temperature, top_p, seed):
        out = []
        for prompt in prompts:
            self.contexts.append(list(prompt))
            ids = self.tokenizer(self.reply(self.tokenizer.decode(prompt)), add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tokenizer.eos_token_id])[:max_new_tokens]
            out.append([Completion(ids, [-0.5] * len(ids), len(ids) == max_new_tokens and ids[-1] != 2,
                                   self.tokenizer.decode(ids, skip_special_tokens=True))])
        return out


class Recording:
    """A real sampler, its outputs recorded."""

    def __init__(self, sampler):
        self.sampler, self.tokenizer, self.outputs, self.contexts = sampler, sampler.tokenizer, [], []

    def generate(self, prompts, n, **kwargs):
        self.contexts += [list(p) for p in prompts]
        groups = self.sampler.generate(prompts, n, **kwargs)
        self.outputs += [group[0] for group in groups]
        return groups


def test_turns_are_sampled_from_the_sampled_ids_not_from_their_text_encoded_again(tokenizer, scorer, compose):
    """tiny_random writes random tokens, whose text encodes to other ids: the episode keeps the sampled ones, and each
    later turn's context is the earlier context, the sampled ids and the suffix, as ids."""
    from fgrpo.learner.model import load_policy, resolve_model_folder
    from fgrpo.rollout.samplers import HFSampler

    folder = resolve_model_folder(compose("model=tiny_random").model)
    sampler = Recording(HFSampler(load_policy(folder, dtype="float32", device="cpu"), tokenizer))
    env = environment("Countdown", tokenizer)
    # one episode per problem: each episode's contexts are those that start with its own prompt
    groups = sample_episodes(sampler, problems(4), env, scorer, scorer.pool, group_size=1, max_new_tokens=12,
                             temperature=1.0, top_p=1.0, seed=0)
    reencoded_differs = False
    for completion in [c for group in groups.completions for c in group]:
        record = completion.episode
        assert record.turns == 3 and completion.loss_mask.count(0) > 0  # random text is never the answer
        contexts = [c for c in sampler.contexts if c[: len(record.prompt_ids)] == record.prompt_ids]
        full = record.prompt_ids + completion.token_ids
        for context in contexts:  # every turn's context is a prefix of the episode, as ids
            assert full[: len(context)] == context
        sampled = [t for t, keep in zip(completion.token_ids, completion.loss_mask) if keep]
        outputs = [o for o in sampler.outputs if any(o.token_ids == full[len(c): len(c) + len(o.token_ids)]
                                                     for c in contexts)]
        assert sum((o.token_ids for o in outputs), []) == sampled  # the turns' tokens, exactly as sampled
        text = tokenizer.decode(sampled, skip_special_tokens=False)
        reencoded_differs |= tokenizer(text, add_special_tokens=False)["input_ids"] != sampled
    assert reencoded_differs  # the case the rule is for: encoding the decoded text gives other ids


def test_a_game_won_on_the_second_try_its_mask_rewards_and_metrics(tokenizer, scorer):
    answers = {p.id: p.answer for p in problems(2)}

    def reply(context):  # wrong first, right after "higher" or "lower"
        answer = next(a for pid, a in answers.items() if f"What is {pid.split('/')[1].replace('+', ' + ')}?" in context)
        return answer if "higher" in context or "lower" in context else "0" if answer != "0" else "1"

    sampler = Scripted(tokenizer, reply)
    groups = sample_episodes(sampler, problems(2), environment("Countdown", tokenizer), scorer, scorer.pool,
                             group_size=2, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    assert groups.correct.tolist() == [[1.0, 1.0], [1.0, 1.0]] and groups.rewards.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    completion = groups.completions[0][0]
    record = completion.episode
    assert (record.turns, record.env_parts, record.truncated) == (2, {"tries": 2.0}, False)
    assert [m["role"] for m in record.messages] == ["user", "assistant", "user", "assistant"]
    first = sampler.contexts[0]
    turn_ids = completion.token_ids[: completion.loss_mask.index(0)]
    suffix = completion.token_ids[len(turn_ids): len(turn_ids) + completion.loss_mask.count(0)]
    assert tokenizer.decode(suffix) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert completion.logprobs[len(turn_ids): len(turn_ids) + len(suffix)] == [0.0] * len(suffix)
    assert sampler.contexts[4] == first + turn_ids + suffix  # episode 0, second round (4 episodes a round)
    metrics = episode_metrics(groups, "train")
    assert metrics["train/env/turns_mean"] == 2.0 and metrics["train/env/reward/tries"] == 2.0
    assert metrics["train/env/sampled_tokens_mean"] == sum(completion.loss_mask)


def test_tool_calls_well_formed_malformed_unknown_and_the_budget(tokenizer, scorer):
    calls = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call> <tool_call>{oops</tool_call> '
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>']

    def reply(context):
        turn = context.count("<|im_start|>assistant") - 1
        return calls[turn] if turn < len(calls) else "The answer is 5."

    rewards = reward_entries([{"fn": "numeric"}])
    judged = Scorer(rewards, workers=1)
    judged.pool = scorer.pool
    env = environment("Tools", tokenizer, max_tokens=600)
    groups = sample_episodes(Scripted(tokenizer, reply), problems(1), env, judged, scorer.pool, group_size=2,
                             max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0)
    record = groups.completions[0][0].episode
    assert (record.turns, record.tool_calls, record.tool_errors, record.truncated) == (3, 4, 3, False)
    tools = [m["content"] for m in record.messages if m["role"] == "tool"]
    assert tools[0] == "5" and "missing a required argument" in tools[1] and "not valid JSON" in tools[2]
    assert "unknown tool 'nope'" in tools[3]
    assert record.env_reward == 0.0 and record.env_correct is False  # get_reward: the last add was not the answer
    # the budget: the same script with room for the first turn only
    short = environment("Tools", tokenizer, max_tokens=30)
    groups = sample_episodes(Scripted(tokenizer, reply), problems(1), short, scorer, scorer.pool, group_size=2,
                             max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0)
    cut = groups.completions[0][0]
    assert cut.episode.truncated and len(cut.token_ids) == 30 and cut.truncated
    # DAPO's overlong rule reads an episode's length against its budget: a cut one gets the whole penalty
    assert overlong_penalties(groups, short.max_tokens, 10, 1.0).tolist() == [[-1.0, -1.0]]


def test_a_class_failing_every_episode_of_the_first_batch_stops_the_run(tokenizer, scorer):
    env = environment("RaisingReset", tokenizer)
    with pytest.raises(RewardError, match="failed every one of the 4 episodes of its first batch"):
        sample_episodes(Scripted(tokenizer, lambda c: "1"), problems(2), env, scorer, scorer.pool, group_size=2,
                        max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
