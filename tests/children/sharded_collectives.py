"""The loop's small collectives on 2 real ranks (gloo), no model: ``torchrun --nproc_per_node 2
tests/children/sharded_collectives.py OUT_PREFIX`` writes ``OUT_PREFIX.<rank>.json`` with what each rank saw.

- ``agree``: rank 1's check fails (a ConfigError); both ranks raise it, with rank 1's message.
- DAPO dynamic sampling over ranks: rank 0's draws have mixed groups, rank 1's none; the count kept is the run's.
- evaluation: 5 problems over 2 ranks (padded to 3 each), every rank gets the 5 counts in order.
- tensor parallel 2 (one engine over both ranks, the same draw on each): each rank scores half the samples, in a
  worker that reports the rank it serves, and both get every score.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fgrpo.infra import distributed  # noqa: E402
from fgrpo.infra.errors import ConfigError  # noqa: E402
from fgrpo.rollout.data import Problem  # noqa: E402
from fgrpo.evaluation.held_out import evaluate  # noqa: E402
from fgrpo.rewards.entries import reward_entries  # noqa: E402
from fgrpo.rewards.scoring import Scorer  # noqa: E402
from dataclasses import replace  # noqa: E402

from fgrpo.rewards.binding import sample_view  # noqa: E402
from fgrpo.rollout.rollouts import Groups, ProblemStream, collect_groups, score_engine_draw  # noqa: E402
from fgrpo.rollout.samplers import Completion  # noqa: E402


def check_fails_on_rank_1(rank: int) -> None:
    if rank == 1:
        raise ConfigError("rank 1's data file is missing")


class CountingSampler:
    """Problem i's prompt is [i]; its n samples answer "1" for the first i % (n + 1) of them (verifier: == answer)."""

    def generate(self, prompts, n, **_):
        return [[Completion([1], [-0.1], False, "1" if j < p[0] % (n + 1) else "0") for j in range(n)] for p in prompts]


def main(out_prefix: str) -> None:
    ranks = distributed.init_from_env(timeout_s=60)
    seen = {}
    try:
        distributed.agree(lambda: check_fails_on_rank_1(ranks.rank))
    except ConfigError as error:
        seen["agree"] = str(error)

    problems = [Problem(f"p{i}", f"q{i}", "1", "toy") for i in range(40)]

    def draw(batch, seeds):  # rank 0: groups with 2 of 4 correct (mixed); rank 1: none correct
        correct = torch.tensor([[1.0, 1.0, 0.0, 0.0] if ranks.rank == 0 else [0.0] * 4 for _ in batch])
        return Groups(batch, [[Completion([1], [-0.1], False, "x")] * 4 for _ in batch], correct)

    groups = collect_groups(draw, ProblemStream(problems, seed=0), 4, seed=11, dynamic_sampling=True, max_rounds=3,
                            ranks=ranks)
    seen["dynamic_kept"] = len(groups)

    eval_set = [Problem(f"e{i}", f"q{i}", "1", "toy") for i in range(5)]
    prompt_ids = {p.id: [i] for i, p in enumerate(eval_set)}
    scorer = Scorer(reward_entries([{"fn": "numeric"}]))  # "1" against the answer "1": the counting sampler's rule
    metrics, _, _ = evaluate(CountingSampler(), {"toy": eval_set}, prompt_ids, scorer,
                          n_samples=4, max_problems=5, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=0,
                          ranks=ranks)
    seen["pass@1"] = metrics["eval/pass@1"]

    reward = Path(f"{out_prefix}.reward{ranks.rank}.py")
    reward.write_text("import os\ndef which_rank(completion):\n    return float(os.environ['RANK'])\n")
    scorer = Scorer(reward_entries([{"fn": f"{reward}:which_rank"}]), workers=1)
    scorer.describe()
    views = [sample_view(completion=str(i), completion_ids=[i], prompt="q", answer="1", source="toy", fields={},
                         timeout_s=5.0) for i in range(6)]
    seen["tensor_parallel_scores"] = score_engine_draw(scorer, views, list(range(6)),
                                                       replace(ranks, tensor_parallel=2)).rewards
    scorer.close()
    Path(f"{out_prefix}.{ranks.rank}.json").write_text(json.dumps(seen))
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1])
