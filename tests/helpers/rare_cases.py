"""A tiny random model and sequences to score, shared by the rare-set tests (tests/evaluation/test_rare_set.py) and the
rare_nll command's (tests/test_rare_nll.py)."""

import numpy as np
import torch

from fgrpo.learner.model import load_policy, load_tokenizer, random_folder
from fgrpo.learner.packing import Sequence

TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=1024)  # conf/model/tiny_random.yaml


def tiny_model():
    """The folder, the fp32 policy and the tokenizer of conf/model/tiny_random's shape (seed 0)."""
    folder = random_folder(TINY_SHAPE, seed=0)
    return folder, load_policy(folder, dtype="float32", device="cpu"), load_tokenizer(folder)


def some_sequences(count: int, seed: int = 0) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    return [Sequence(rng.integers(5, 1000, size=rng.integers(3, 12)).tolist(),
                     rng.integers(5, 1000, size=rng.integers(1, 9)).tolist()) for _ in range(count)]


def direct_nll(model, seq: Sequence) -> float:
    """One sequence alone through the model's plain forward: -mean log p of its completion tokens."""
    ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    start = len(seq.prompt_ids)
    targets = torch.tensor(seq.completion_ids)
    return float(-logp[start - 1:-1].gather(-1, targets[:, None]).mean())
