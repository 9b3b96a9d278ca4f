"""How the sampler should get a LoRA policy: merged weights pushed into vLLM, or vLLM's own LoRA support.

Two ways to hand vLLM the current policy each step, each timed in its own process on the same model, adapters and
prompts:

1. **merged** (what fgrpo does): every adapted layer's weight merged out of place (W + B A alpha / r) and pushed
   into the engine with the other weights (``VLLMSampler.update_weights``); vLLM then samples a plain model;
2. **vllm-lora**: the adapters written in PEFT's format and handed to vLLM as a ``LoRARequest`` (a new one each step,
   as a policy that changes each step needs); vLLM samples the base with the adapters applied on the fly.

Each step changes the adapters (as an optimizer step would), pushes, and samples P prompts x G samples of up to T
new tokens. The first step is a warm-up and is dropped; the table gives medians of push, sample and their sum, and
the process's peak RSS. Both ways sample with temperature 0 once at the end from the same adapters: the share of
generated tokens that agree says both compute the same policy (bf16 rounding may part them late in a sequence);
the base model's greedy tokens against the merged policy's show that the adapters change what is sampled.

    python bench/lora_push.py                       # rank 16, 8 x 8 x 32 (the default task's step), 6 steps
    python bench/lora_push.py --rank 64 --workload 8x8x128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "bench") not in sys.path:  # compare_trl beside this file: one parser of PxGxT workloads
    sys.path.insert(0, str(REPO / "bench"))
from compare_trl import parse_workload  # noqa: E402

WAYS = ("merged", "vllm-lora")


def policy_and_prompts(args):
    """The bundled (or named) model with LoRA adapters of ``args.rank``, and P encoded training prompts."""
    import torch
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fgrpo.config import register_configs
    from fgrpo.learner.lora import LoraSettings, apply_lora
    from fgrpo.learner.model import resolve_model_folder
    from fgrpo.prepare import encode_prompt, load_data

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={args.model}"])
    folder = resolve_model_folder(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [encode_prompt(tokenizer, cfg.model, q)
               for q in load_data(cfg.dataset, instruction=cfg.model.instruction).train[: args.workload[0]]]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    settings = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, dropout=0.0, target_modules=None)
    apply_lora(model, settings)
    return model, settings, folder, prompts


def lora_slot(rank: int) -> int:
    """vLLM's LoRA slots come in fixed ranks (1, 8, 16, 32, 64, ...): the smallest that holds ``rank``."""
    return next(slot for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512) if slot >= rank)


def change_adapters(model, step: int) -> None:
    """What an optimizer step does to the policy, for the push's sake: new values in every adapter (B nonzero)."""
    import torch

    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.02 if ".lora_B." in name else 0.1))


def child(way: str, args) -> dict:
    """Run ``way`` for ``args.steps`` steps; its timings, peak RSS and the greedy tokens of the last adapters."""
    from vllm import SamplingParams, TokensPrompt

    from fgrpo.learner.lora import save_adapter
    from fgrpo.rollout.samplers import VLLMSampler, in_process_vllm

    model, settings, folder, prompts = policy_and_prompts(args)
    p, g, t = args.workload
    if way == "merged":
        sampler = VLLMSampler(folder, dtype=args.dtype, max_model_len=512, seed=0, device="cpu")
        llm = sampler.llm
    else:  # an engine with LoRA slots, as VLLMSampler builds its own otherwise (in this process, 2 GiB KV cache)
        from vllm import LLM

        in_process_vllm()
        llm = LLM(model=str(folder), dtype=args.dtype, max_model_len=512, seed=0, enforce_eager=True,
                  enable_prefix_caching=True, disable_log_stats=True, kv_cache_memory_bytes=2 * 2**30,
                  enable_lora=True, max_lora_rank=lora_slot(args.rank), max_loras=1)
    adapters = Path(tempfile.mkdtemp(prefix="fgrpo-lora-push-"))
    steps = []

    def sample(n, temperature, request):
        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, max_tokens=t, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], params, use_tqdm=False,
                                    **({"lora_request": request} if request else {}))

    def push(step):
        if way == "merged":
            sampler.update_weights(model)
            return None
        from vllm.lora.request import LoRARequest

        save_adapter(model, settings, adapters / f"step{step}", folder)
        return LoRARequest(f"step{step}", step + 1, str(adapters / f"step{step}"))

    # the base model's greedy tokens (merged: before the first push), to show the adapters change what is sampled
    base = [list(r.outputs[0].token_ids) for r in sample(1, 0.0, None)] if way == "merged" else None
    request = None
    for step in range(args.steps):
        change_adapters(model, step)
        started = time.perf_counter()
        request = push(step)
        pushed = time.perf_counter()
        outputs = sample(g, 1.0, request)
        done = time.perf_counter()
        steps.append({"push_s": pushed - started, "sample_s": done - pushed,
                      "tokens": sum(len(o.token_ids) for r in outputs for o in r.outputs)})
    greedy = [list(r.outputs[0].token_ids) for r in sample(1, 0.0, request)]
    return {"steps": steps, "greedy": greedy, "base_greedy": base, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions, up to each pair's first difference, that agree: 1.0 when every sequence is identical."""
    same = total = 0
    for x, y in zip(a, b):
        total += max(len(x), len(y))
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / max(total, 1)


def table(results: dict, args) -> str:
    from fgrpo.infra.precision import describe_cpu

    p, g, t = args.workload
    lines = [f"LoRA rank {args.rank} (alpha {2 * args.rank}) on {args.model}, {p} prompts x {g} samples x {t} new tokens "
             f"(EOS ignored), sampler {args.dtype}; {args.steps} steps, the first dropped; {describe_cpu()}, "
             f"{os.cpu_count()} cores.", "",
             "| way | push s | sample s | push + sample s | generated tok/s | peak RSS GiB |", "|---|---|---|---|---|---|"]
    for way, r in results.items():
        kept = r["steps"][1:] or r["steps"]
        push = statistics.median(s["push_s"] for s in kept)
        sample = statistics.median(s["sample_s"] for s in kept)
        tokens = statistics.median(s["tokens"] / s["sample_s"] for s in kept)
        lines.append(f"| {way} | {push:.3f} | {sample:.2f} | {push + sample:.2f} | {tokens:.0f} | {r['peak_rss_gib']:.2f} |")
    if len(results) == 2:
        share = agreement(results["merged"]["greedy"], results["vllm-lora"]["greedy"])
        base = agreement(results["merged"]["base_greedy"], results["merged"]["greedy"])
        lines += ["", f"Greedy tokens from the same adapters that agree, up to each sequence's first difference: "
                      f"{100 * share:.1f}% (the base model's against the merged policy's: {100 * base:.1f}%)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--workload", type=parse_workload, default=(8, 8, 32), metavar="PxGxT",
                        help="prompts x samples x new tokens per step (default 8x8x32, the default task's)")
    parser.add_argument("--steps", type=int, default=6, help="steps per way, the first dropped (default 6)")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model name (default: the bundled model)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the sampler's dtype (default bfloat16; float32 on a CPU without native bf16)")
    parser.add_argument("--only", choices=WAYS, help="run one way only")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--_child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank < 1 or args.steps < 2:
        parser.error("--rank must be >= 1 and --steps >= 2 (the first step is dropped)")
    args.workload = tuple(args.workload)
    if args._child:
        Path(args._out).write_text(json.dumps(child(args._child, args)))
        return 0

    results = {}
    for way in [args.only] if args.only else WAYS:
        print(f"running {way} ...", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--_child", way,
                       "--_out", str(out)]
            env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-2000:] + done.stderr[-4000:], file=sys.stderr)
                print(f"{way} failed (exit {done.returncode})", file=sys.stderr)
                return 1
            results[way] = json.loads(out.read_text())
    print(table(results, args))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")
                                                  and k != "json"}, "results": results}, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
