"""The learner alone: one optimizer step of fgrpo's learner on a synthetic RL batch, timed, against the device's
measured matmul rate. No sampler, no model folder on disk (random weights built in memory): what
``bench/compare_trl.py`` measures as "learning s", in a minute instead of many, for comparing learner layouts.

    python bench/learner_step.py --device cuda                                   # Qwen2.5-1.5B's shape, 16x8x512
    python bench/learner_step.py --device cuda --set attention=sdpa --set micro_batch_tokens=null --set share_prompts=false
    python bench/learner_step.py --device cpu --model tiny_random --workload 2x4x16 --steps 2   # a smoke run

The batch: P prompts of ``--prompt-tokens`` random tokens, each with G completions of T tokens (a random-weight
model never stops early, so the sampler's batches at this workload are the same shape). Hardware keys come from
``conf/hardware/<gpu|cpu>.yaml`` with ``--set KEY=VALUE`` on top. FLOPs counted as compare_trl counts them:
6 x (body params x positions computed + head params x completion tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fgrpo.learner.compiled_layers import compile_decoder_layers  # noqa: E402
from fgrpo.learner.learner import update_policy  # noqa: E402
from fgrpo.algorithm.losses import LossSettings  # noqa: E402
from fgrpo.learner.packing import Sequence  # noqa: E402


def hardware_keys(device: str, overrides: list[str]):
    """conf/hardware/<gpu|cpu>.yaml over the schema's defaults (fgrpo.config.HardwareConfig), then ``overrides``."""
    from omegaconf import OmegaConf

    from fgrpo.config import HardwareConfig

    option = OmegaConf.load(REPO / "conf" / "hardware" / f"{'gpu' if device == 'cuda' else 'cpu'}.yaml")
    return OmegaConf.merge(OmegaConf.structured(HardwareConfig), option, OmegaConf.from_dotlist(overrides))


def build_model(name: str, device: str, attention: str):
    from transformers import AutoModelForCausalLM

    from fgrpo.learner.flex_attention import FLEX_ATTENTION
    from fgrpo.learner.model import random_config
    from fgrpo.learner.segment_attention import SEGMENT_ATTENTION

    shape = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())["random_init"]
    config = random_config(shape, vocab_size=49152)  # SmolLM2's tokenizer, as fgrpo.learner.model.random_folder
    implementation = {"flex": FLEX_ATTENTION, "segments": SEGMENT_ATTENTION}.get(attention, attention)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=implementation)
    return model.train()


def batch(prompts: int, group: int, tokens: int, prompt_tokens: int, vocab: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for p in range(prompts):
        prompt = torch.randint(10, vocab, (prompt_tokens,), generator=gen).tolist()
        for i in range(group):
            completion = torch.randint(10, vocab, (tokens,), generator=gen).tolist()
            seqs.append(Sequence(prompt, completion, advantage=(-1.0) ** i))
    return seqs


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device == "cuda" else 512  # small on a CPU: bf16 emulated on AVX2-only CPUs is ~200x slower
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--model", default="qwen2_5_1_5b_random", help="a conf/model file with random_init")
    parser.add_argument("--workload", default="16x8x512", help="prompts x samples x completion tokens")
    parser.add_argument("--prompt-tokens", type=int, default=44, help="tokens per prompt (compare_trl's: 44)")
    parser.add_argument("--steps", type=int, default=3, help="steps; the first (compile) is dropped")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the learner's matmul dtype (autocast over fp32 weights) and the rate it is held to")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a hardware key over conf/hardware/<gpu|cpu>.yaml, e.g. attention=sdpa")
    args = parser.parse_args(argv)
    p, g, t = (int(x) for x in args.workload.split("x"))
    hw = hardware_keys(args.device, args.overrides)
    model = build_model(args.model, args.device, hw["attention"])
    if hw["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
    kept_gib = float(hw["keep_matmul_outputs_gib"] or 0) if hw["keep_matmul_outputs_gib"] != "auto" else 0.0
    if hw["compile_learner"]:
        compile_decoder_layers(model, selective_checkpoint=kept_gib > 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    loss = LossSettings(algo="dapo", clip_low=0.2, clip_high=0.28, agg="token-mean", kl_coef=0.0, entropy_coef=0.0)
    seqs = batch(p, g, t, args.prompt_tokens, model.config.vocab_size)
    dtype = getattr(torch, args.dtype)
    times, metrics = [], {}
    for step in range(args.steps):
        sync(args.device)
        start = time.perf_counter()
        metrics = update_policy(model, optimizer, seqs, loss=loss, pad_id=0, temperature=1.0,
                                micro_batch_size=hw["micro_batch_size"], micro_batch_tokens=hw["micro_batch_tokens"],
                                share_prompts=hw["share_prompts"], grad_clip=1.0, max_new_tokens=t,
                                autocast_dtype=dtype if dtype == torch.bfloat16 else None,
                                kept_matmul_bytes=int(kept_gib * 2**30))
        sync(args.device)
        times.append(time.perf_counter() - start)
        print(f"step {step}: {times[-1]:.3f} s", file=sys.stderr, flush=True)
    head = model.get_output_embeddings().weight.numel()
    body = sum(x.numel() for x in model.parameters()) - head
    computed = metrics["computed_tokens"]
    flops = 6 * (body * computed + head * p * g * t)
    median = statistics.median(times[1:] or times)
    rate = matmul_rate(args.device, dtype)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"| {name} | {args.model} {args.workload} | {' '.join(args.overrides) or 'defaults'} | {median:.3f} s | "
          f"{flops / median / 1e12:.2f} TFLOP/s | {100 * flops / median / rate:.1f}% of {args.dtype} matmul "
          f"{rate / 1e12:.2f} | "
          f"padding {100 * metrics['padding_frac']:.1f}% | peak {peak:.1f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
