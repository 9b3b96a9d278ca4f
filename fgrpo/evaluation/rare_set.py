"""The rare-trajectory set (the paper's Delta NLL_rare): correct completions the base model found only rarely, and
each model's length-normalised NLL on them. ``python -m fgrpo.rare_nll`` builds and scores sets; a training run with
``eval.rare_set=DIR`` scores its policy at every evaluation (:func:`score`).

NLL here is ``-mean_t log pi(y_t | x, y_<t)`` over a completion's tokens, at temperature 1 (the paper samples at 1.0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fgrpo.learner.forward import completion_logprobs
from fgrpo.learner.packing import Sequence


SET_FILE = "rare_set.jsonl"
META_FILE = "rare_set.json"
SCORE_TOKENS = 16_384  # padded token slots per no-grad forward: long reasoning traces go a few at a time


def token_budget_batches(seqs: list[Sequence], budget: int) -> list[list[Sequence]]:
    """Consecutive batches whose padded size (count x longest prompt + completion) stays within ``budget`` token
    slots; a sequence longer than the budget goes alone."""
    batches, batch, longest = [], [], 0
    for seq in seqs:
        length = len(seq.prompt_ids) + len(seq.completion_ids)
        if batch and (len(batch) + 1) * max(longest, length) > budget:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(seq)
        longest = max(longest, length)
    return batches + [batch] if batch else batches


def length_normalised_nll(model, seqs: list[Sequence], *, pad_id: int, budget: int = SCORE_TOKENS) -> np.ndarray:
    """``[S]`` float64: each completion's mean token NLL under ``model`` at temperature 1, without gradients.

    Several ranks with a sharded model: every rank must pass the same ``seqs`` (each forward is collective).
    """
    if any(not s.completion_ids for s in seqs):
        raise ValueError("every sequence needs at least one completion token to have a length-normalised NLL")
    was_training = model.training
    model.eval()
    nll = []
    try:
        with torch.no_grad():
            for batch in token_budget_batches(seqs, budget):
                logp, mask, _ = completion_logprobs(model, batch, pad_id=pad_id, temperature=1.0)
                token_counts = mask.sum(dim=1).double()
                nll += (-(logp.double() * mask).sum(dim=1) / token_counts).tolist()
    finally:
        model.train(was_training)
    return np.asarray(nll, dtype=np.float64)


def select_rarest(nll: np.ndarray, fraction: float) -> np.ndarray:
    """Indices of the ``fraction`` of ``nll`` ``[S]`` with the highest values (at least one), highest first."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if nll.ndim != 1 or nll.size == 0:
        raise ValueError(f"nll must be a non-empty 1-D array, got shape {nll.shape}")
    keep = max(1, int(round(fraction * nll.size)))
    return np.argsort(-nll, kind="stable")[:keep]


@dataclass
class RareSet:
    """The fixed set of rare correct trajectories and the base model's NLL on each."""

    problems: list[str]
    seqs: list[Sequence]
    base_nll: np.ndarray  # [S]
    meta: dict

    @property
    def base_mean(self) -> float:
        return float(self.base_nll.mean())


def save_rare_set(out_dir: Path, rare: RareSet, texts: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / SET_FILE, "w", encoding="utf-8") as file:
        for problem, seq, nll, text in zip(rare.problems, rare.seqs, rare.base_nll, texts):
            file.write(json.dumps({"problem": problem, "prompt_ids": seq.prompt_ids, "completion_ids": seq.completion_ids,
                                   "base_nll": float(nll), "text": text}) + "\n")
    (out_dir / META_FILE).write_text(json.dumps(rare.meta, indent=2) + "\n")


def load_rare_set(path: str | Path) -> RareSet:
    """A set written by ``build``: its folder or its rare_set.jsonl. Raises ValueError naming what is missing."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not (folder / SET_FILE).is_file():
        raise ValueError(f"{path}: no {SET_FILE} there; build one with `python -m fgrpo.rare_nll build --out DIR`")
    rows = [json.loads(line) for line in (folder / SET_FILE).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{folder / SET_FILE} is empty")
    meta = json.loads((folder / META_FILE).read_text()) if (folder / META_FILE).is_file() else {}
    return RareSet([r["problem"] for r in rows], [Sequence(r["prompt_ids"], r["completion_ids"]) for r in rows],
                   np.array([r["base_nll"] for r in rows], dtype=np.float64), meta)


def check_vocabulary(rare: RareSet, vocab_size: int) -> None:
    """The set's token ids must be the model's: a set built with another tokenizer would score nonsense."""
    largest = max(max(s.prompt_ids + s.completion_ids) for s in rare.seqs)
    if largest >= vocab_size:
        raise ValueError(f"the rare set holds token id {largest}, past this model's vocabulary of {vocab_size}: it was "
                         f"built with another tokenizer (its model: {rare.meta.get('model', 'unknown')}); build one with "
                         "this model's tokenizer")


def score(model, rare: RareSet, *, pad_id: int) -> dict[str, float]:
    """``rare_nll``: the model's mean length-normalised NLL on the set; ``rare_nll_delta``: minus the base's."""
    mean = float(length_normalised_nll(model, rare.seqs, pad_id=pad_id).mean())
    return {"rare_nll": mean, "rare_nll_delta": mean - rare.base_mean}
