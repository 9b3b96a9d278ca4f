"""A two-step TRL GRPOTrainer run with fgrpo's FocalGRPOTrainer on the tiny random Llama, recording what each step
trains on: used in-process by tests/integrations/test_trl.py and, on two ranks, as
``torchrun --nproc_per_node 2 trl_case.py MODEL_FOLDER OUT SCALE GAMMA``."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch


def solved(completions, **_) -> list[float]:
    """The verdict: a stable coin from the completion's text (about half of a random model's completions)."""
    return [float(zlib.crc32(c.encode()) % 2) for c in completions]


def length_bonus(completions, **_) -> list[float]:
    """A shaped second reward, so that the verdict is one column of several."""
    return [len(c) / 100 for c in completions]


def recording_trainer(model_folder: Path, out_dir: Path, *, scale_rewards: str, gamma: float, per_device: int,
                      generations: int, aggregation: str = "sum_then_normalize"):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from fgrpo.integrations.trl import FocalGRPOTrainer

    class Recording(FocalGRPOTrainer):
        """Keeps each generation's gathered rewards and the advantages the loss will read."""
        records: list = []

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.records.append({"rewards": self._gathered_rewards.cpu().tolist(),
                                 "advantages": out["advantages"].cpu().tolist(),
                                 "rank": self.accelerator.process_index})
            return out

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    args = GRPOConfig(output_dir=str(out_dir), use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0,
                      per_device_train_batch_size=per_device, num_generations=generations, max_completion_length=6,
                      max_steps=2, logging_steps=1, save_strategy="no", report_to="none", learning_rate=1e-3,
                      scale_rewards=scale_rewards, multi_objective_aggregation=aggregation, temperature=1.0,
                      dataloader_num_workers=0)
    prompts = Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(16)]})
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    return Recording(model=model, reward_funcs=[solved, length_bonus], args=args, train_dataset=prompts,
                     processing_class=tokenizer, focal_gamma=gamma, verdict="solved", success_threshold=1.0)


if __name__ == "__main__":  # torchrun --nproc_per_node 2 trl_case.py MODEL_FOLDER OUT SCALE GAMMA
    folder, out, scale, gamma = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    # 6 completions a rank, groups of 4: rank 0 holds group 0 and half of group 1, rank 1 the rest of 1 and group 2
    trainer = recording_trainer(folder, out, scale_rewards=scale, gamma=gamma, per_device=6, generations=4)
    trainer.train()
    (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(trainer.records))
