"""TRL's learner alone: one optimizer step of trl's GRPOTrainer on the synthetic batch of bench/learner_step.py, timed.

No generation: the trainer's generation hook hands back a prepared batch (prompt and completion ids and masks, the
advantages), and TRL's own training loop does the rest as in a real run: its loss (``loss_type="dapo"``, beta 0),
the backward in micro-batches with gradient accumulation, gradient clipping and the optimizer step. What
``bench/compare_trl.py`` reports as TRL's "learning s", without the minutes of sampling before it.

    python bench/trl_learner_step.py --device cuda                              # Qwen2.5-1.5B's shape, 16x8x512
    python bench/trl_learner_step.py --device cpu --model tiny_random --workload 2x4x16 --steps 2   # a smoke run

Same model (random weights built in memory, fp32; sdpa attention, TRL's usual), same prompts and completions as
bench/learner_step.py. On CUDA TRL's usual mixed precision (fp32 weights, bf16 autocast); on CPU fp32. The
micro-batch and gradient checkpointing follow conf/hardware/<gpu|cpu>.yaml (``hardware.micro_batch_size``,
``hardware.gradient_checkpointing``) with ``--set KEY=VALUE`` on top, as compare_trl's TRL follows ours. FLOPs are
counted over what TRL computes: each sequence's prompt and completion (no shared prompts), head x completion tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = str(Path(__file__).resolve().parent)
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from learner_step import GIB, batch, build_model, hardware_keys, matmul_rate, sync, workload_parser  # noqa: E402

TRL_MISSING = "TRL is not installed: pip install 'fgrpo[bench]'"


def prepared_inputs(seqs, device: str, pad_id: int) -> dict:
    """The batch as TRL's ``_generate_and_score_completions`` returns it: left-padded prompts, right-padded
    completions, their masks, one advantage per sequence and the batch's completion-token count."""
    def padded(rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            span = slice(width - len(r), width) if left else slice(0, len(r))
            ids[i, span], mask[i, span] = torch.tensor(r), 1
        return ids.to(device), mask.to(device)

    prompt_ids, prompt_mask = padded([s.prompt_ids for s in seqs], left=True)
    completion_ids, completion_mask = padded([s.completion_ids for s in seqs], left=False)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor([s.advantage for s in seqs], dtype=torch.float32, device=device),
            "num_items_in_batch": completion_mask.sum()}


def no_reward(completions, **_):  # never called: the generation hook is replaced
    return [0.0] * len(completions)


def grpo_config(args, workload, micro: int, accumulation: int, checkpointing: bool, out: str):
    """The GRPOConfig of bench/compare_trl_children.trl_config, less what generation needs."""
    from trl import GRPOConfig

    _, g, t = workload
    on_gpu = args.device == "cuda"
    return GRPOConfig(
        output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=g, num_iterations=1, max_completion_length=t,
        beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, learning_rate=1e-6, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, max_steps=args.steps, use_vllm=False, bf16=on_gpu, fp16=False,
        use_cpu=not on_gpu, gradient_checkpointing=checkpointing, shuffle_dataset=False, seed=0,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
    )


def timed_trainer(model, tokenizer, config, prepared: dict, prompts: int, device: str) -> tuple[object, list[dict]]:
    """A GRPOTrainer whose generation hands back ``prepared``, and the list its steps' times go into."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    steps: list[dict] = []
    now = {"prep_s": 0.0}

    class PreparedBatchTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return dict(prepared)
            finally:
                now["prep_s"] += time.perf_counter() - start

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync(device)
            now.update(prep_s=0.0, start=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            total = time.perf_counter() - now["start"]
            steps.append({"step_s": total, "learn_s": total - now["prep_s"]})
            print(f"step {len(steps) - 1}: {steps[-1]['learn_s']:.3f} s", file=sys.stderr, flush=True)

    dataset = Dataset.from_dict({"prompt": ["-"] * (prompts * config.max_steps)})  # read by no one but the sampler
    trainer = PreparedBatchTrainer(model=model, reward_funcs=no_reward, args=config, train_dataset=dataset,
                                   processing_class=tokenizer, callbacks=[StepTimer()])
    return trainer, steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = workload_parser(__doc__)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is dropped")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a hardware key over conf/hardware/<gpu|cpu>.yaml: micro_batch_size, "
                             "gradient_checkpointing (what TRL follows)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write every number here (scripts/gpu_check.py reads it)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if importlib.util.find_spec("trl") is None:
        parser.error(TRL_MISSING)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import trl

    from fgrpo.learner.model import bundled_folder, load_tokenizer

    p, g, t = workload = tuple(int(x) for x in args.workload.split("x"))
    hw = hardware_keys(args.device, args.overrides)
    micro = min(int(hw["micro_batch_size"]), p * g)
    if (p * g) % micro:
        raise SystemExit(f"micro_batch_size {micro} must divide P x G = {p * g}")
    checkpointing = bool(hw["gradient_checkpointing"])
    model = build_model(args.model, args.device, "sdpa")
    tokenizer = load_tokenizer(bundled_folder())  # SmolLM2's, as the random models' folders carry
    seqs = batch(p, g, t, args.prompt_tokens, model.config.vocab_size)
    prepared = prepared_inputs(seqs, args.device, tokenizer.pad_token_id)
    with tempfile.TemporaryDirectory(prefix="trl-learner-") as out:
        config = grpo_config(args, workload, micro, p * g // micro, checkpointing, out)
        trainer, steps = timed_trainer(model, tokenizer, config, prepared, p, args.device)
        torch.manual_seed(0)
        trainer.train()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rate = matmul_rate(args.device, dtype)
    head = model.get_output_embeddings().weight.numel()
    body = sum(x.numel() for x in model.parameters()) - head
    flops = 6 * (body * p * g * (args.prompt_tokens + t) + head * p * g * t)
    measured = [s["learn_s"] for s in (steps[1:] or steps)]
    median = statistics.median(measured)
    peak = torch.cuda.max_memory_allocated() / GIB if args.device == "cuda" else None
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    setting = f"micro-batch {micro} x {p * g // micro}" + (", checkpointing" if checkpointing else "")
    print(f"| {name} | trl {trl.__version__} {args.model} {args.workload} | {setting} | {median:.3f} s | "
          f"{flops / median / 1e12:.2f} TFLOP/s | {100 * flops / median / rate:.1f}% of {str(dtype)[6:]} matmul "
          f"{rate / 1e12:.2f} | peak {peak if peak is not None else float('nan'):.1f} GiB |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": name, "trl": trl.__version__, "model": args.model, "workload": args.workload,
            "prompt_tokens": args.prompt_tokens, "micro_batch": micro, "accumulation": p * g // micro,
            "gradient_checkpointing": checkpointing, "dtype": str(dtype)[6:],
            "step_s": [round(s["step_s"], 4) for s in steps], "learn_s": [round(s["learn_s"], 4) for s in steps],
            "median_s": median, "flops_per_step": flops, "tflops": flops / median / 1e12,
            "matmul_tflops": rate / 1e12, "pct_of_matmul": 100 * flops / median / rate, "peak_gib": peak}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
