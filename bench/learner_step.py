"""The learner alone: one optimizer step of fgrpo's learner on a synthetic RL batch, timed, against the device's
measured matmul rate. No sampler, no model folder on disk (random weights built in memory): what
``bench/compare_trl.py`` measures as "learning s", in a minute instead of many, for comparing learner layouts.

    python bench/learner_step.py --device cuda                                   # Qwen2.5-1.5B's shape, 16x8x512
    python bench/learner_step.py --device cuda --steps 4 --widths 3 --json learner.json   # what gpu-check runs
    python bench/learner_step.py --device cuda --set attention=sdpa --set micro_batch_tokens=null --set share_prompts=false
    python bench/learner_step.py --device cpu --model tiny_random --workload 2x4x16 --steps 2   # a smoke run

The batch: P prompts of ``--prompt-tokens`` random tokens, each with G completions of T tokens (a random-weight
model never stops early, so the sampler's batches at this workload are the same shape). ``--widths N`` adds N steps
whose completions have lengths drawn anew (1..T) per sequence and step, so each step's packed rows differ in width,
as in a real run: their times and the torch.compile graphs they add are reported apart. Hardware keys come from
``conf/hardware/<gpu|cpu>.yaml`` with ``--set KEY=VALUE`` on top. FLOPs counted as compare_trl counts them:
6 x (body params x positions computed + head params x completion tokens). On CUDA the allocator's memory is split
into the learner's state (weights, gradients, AdamW moments: allocated after the first step) and its activations
(the peak of the later fixed-width steps less the state), each beside fgrpo.learner.gpu_memory's estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fgrpo.algorithm.losses import LossSettings  # noqa: E402
from fgrpo.learner.compiled_layers import compile_decoder_layers  # noqa: E402
from fgrpo.learner.step import matched_micro_batches, update_policy  # noqa: E402
from fgrpo.learner.packing import Sequence  # noqa: E402

GIB = 2**30


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


def batch(prompts: int, group: int, tokens: int, prompt_tokens: int, vocab: int,
          widths_seed: int | None = None) -> list[Sequence]:
    """P x G sequences of random tokens; ``widths_seed`` set: each completion's length drawn from 1..``tokens``."""
    prompt_gen, completion_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    lengths = torch.Generator().manual_seed(widths_seed) if widths_seed is not None else None
    seqs = []
    for p in range(prompts):
        prompt = torch.randint(10, vocab, (prompt_tokens,), generator=prompt_gen).tolist()
        for i in range(group):
            length = tokens if lengths is None else int(torch.randint(1, tokens + 1, (1,), generator=lengths))
            completion = torch.randint(10, vocab, (length,), generator=completion_gen).tolist()
            seqs.append(Sequence(prompt, completion, advantage=(-1.0) ** i))
    return seqs


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device == "cuda" else 512  # small on a CPU: bf16 emulated on AVX2-only CPUs is ~200x slower
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b  # warm-up: cuBLAS's heuristics, the CPU's thread pool
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


def compile_stats() -> dict:
    """What torch.compile did in this process so far: graphs, frames compiled, recompiles (with their reasons)."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = list(get_compilation_metrics())
    reasons = [m.recompile_reason for m in metrics if getattr(m, "recompile_reason", None)]
    return {"graphs": int(counters["stats"]["unique_graphs"]), "frames": len(metrics), "recompiles": len(reasons),
            "compile_s": round(sum(getattr(m, "entire_frame_compile_time_s", None) or 0.0 for m in metrics), 1),
            "recompile_reasons": reasons[:8]}


def memory_estimate(model, hw, dtype: torch.dtype, device: str, micro_batch_tokens: int):
    """fgrpo.learner.gpu_memory's estimate for this model (its shape read from the model in memory), one process."""
    from fgrpo.learner.gpu_memory import learner_memory
    from fgrpo.learner.logprobs import CHUNK_BYTES

    layers = model.base_model.layers
    params = sum(p.numel() for p in model.parameters())
    layer_params = sum(p.numel() for p in layers[0].parameters())
    return learner_memory(params=params, layer_params=layer_params, root_params=params - len(layers) * layer_params,
                          hidden=model.config.hidden_size, layers=model.config.num_hidden_layers,
                          weight_dtype="float32", compute_dtype=str(dtype).removeprefix("torch."), world=1,
                          sharded=False, cpu_offload=False, checkpointing=bool(hw["gradient_checkpointing"]),
                          micro_batch_tokens=micro_batch_tokens, logits_block_bytes=CHUNK_BYTES.get(device, 2**30))


def widest_micro_batch(model, seqs: list[Sequence], hw) -> int:
    """The token slots of the step's widest micro-batch (rows x width), as update_policy lays them out."""
    micros, _ = matched_micro_batches(model, seqs, pad_id=0, micro_batch_size=hw["micro_batch_size"],
                                      micro_batch_tokens=hw["micro_batch_tokens"], share_prompts=hw["share_prompts"])
    return max(m.padded_tokens for m in micros)


def settle_auto_layout(model, hw, args, cuda: bool) -> None:
    """``--set micro_batch_tokens=auto`` / ``keep_matmul_outputs_gib=auto`` on CUDA: sized from the card's memory as
    a run sizes them (fgrpo.learner.gpu_memory.auto_gpu_layout); on the CPU auto keeps no matmul outputs here."""
    if not cuda or "auto" not in (hw["micro_batch_tokens"], hw["keep_matmul_outputs_gib"]):
        if hw["micro_batch_tokens"] == "auto":
            raise SystemExit("micro_batch_tokens=auto sizes from a GPU's memory: on the CPU set a number")
        return
    from fgrpo.learner.gpu_memory import auto_gpu_layout

    card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    dtype = getattr(torch, args.dtype)
    tokens, kept = auto_gpu_layout(lambda n: memory_estimate(model, hw, dtype, "cuda", n), card,
                                   args.prompt_tokens + int(args.workload.split("x")[2]))
    if hw["micro_batch_tokens"] == "auto":
        hw["micro_batch_tokens"] = tokens
    if hw["keep_matmul_outputs_gib"] == "auto":
        hw["keep_matmul_outputs_gib"] = round(kept, 2) if hw["gradient_checkpointing"] and hw["compile_learner"] else 0
    print(f"auto layout: micro-batches of {hw['micro_batch_tokens']} token slots, "
          f"{hw['keep_matmul_outputs_gib']} GiB of matmul outputs kept", file=sys.stderr, flush=True)


def kept_gib(hw) -> float:
    """GiB of matmul outputs kept per micro-batch (hardware.keep_matmul_outputs_gib; its "auto" counts as 0 here)."""
    return float(hw["keep_matmul_outputs_gib"] or 0) if hw["keep_matmul_outputs_gib"] != "auto" else 0.0


def step_flops(model, metrics: dict, seqs: list[Sequence]) -> float:
    head = model.get_output_embeddings().weight.numel()
    body = sum(x.numel() for x in model.parameters()) - head
    return 6 * (body * metrics["computed_tokens"] + head * sum(len(s.completion_ids) for s in seqs))


def run_steps(model, optimizer, hw, args, workload, on_step) -> list[dict]:
    """``args.steps`` steps at full width then ``args.widths`` of drawn widths; each step's time, FLOPs, metrics.
    ``on_step(index)`` runs after each step, outside its time (the memory readings)."""
    p, g, t = workload
    loss = LossSettings(algo="dapo", clip_low=0.2, clip_high=0.28, agg="token-mean", kl_coef=0.0, entropy_coef=0.0)
    dtype = getattr(torch, args.dtype)
    fixed = batch(p, g, t, args.prompt_tokens, model.config.vocab_size)
    steps = []
    for index in range(args.steps + args.widths):
        varied = index >= args.steps
        seqs = batch(p, g, t, args.prompt_tokens, model.config.vocab_size, widths_seed=index) if varied else fixed
        graphs = compile_stats()["graphs"]
        sync(args.device)
        start = time.perf_counter()
        metrics = update_policy(model, optimizer, seqs, loss=loss, pad_id=0, temperature=1.0,
                                micro_batch_size=hw["micro_batch_size"], micro_batch_tokens=hw["micro_batch_tokens"],
                                share_prompts=hw["share_prompts"], grad_clip=1.0, max_new_tokens=t,
                                autocast_dtype=dtype if dtype == torch.bfloat16 else None,
                                kept_matmul_bytes=int(kept_gib(hw) * GIB))
        sync(args.device)
        seconds = time.perf_counter() - start
        steps.append({"s": seconds, "flops": step_flops(model, metrics, seqs), "varied": varied,
                      "padding_frac": metrics["padding_frac"], "computed_tokens": metrics["computed_tokens"],
                      "new_graphs": compile_stats()["graphs"] - graphs})
        print(f"step {index}{' (drawn widths)' if varied else ''}: {seconds:.3f} s, "
              f"{steps[-1]['new_graphs']} new graphs", file=sys.stderr, flush=True)
        on_step(index)
    return steps


def summary(steps: list[dict], rate: float) -> dict:
    """Median step time, and the median of the steps' FLOP rates (the steps' work differs with drawn widths)."""
    rates = [s["flops"] / s["s"] for s in steps]
    return {"step_s": [round(s["s"], 4) for s in steps], "median_s": statistics.median(s["s"] for s in steps),
            "tflops": statistics.median(rates) / 1e12, "pct_of_matmul": 100 * statistics.median(rates) / rate,
            "new_graphs": sum(s["new_graphs"] for s in steps)}


def memory_report(readings: dict, estimate) -> dict:
    """The measured parts (CUDA) beside the estimate's, in GiB, and measured / estimate."""
    est = {name: getattr(estimate, name) / GIB for name in ("weights", "gradients", "moments", "state", "activations",
                                                              "total")}
    if "state" not in readings:
        return {"measured": None, "estimate": est, "ratio": None}
    state = readings["state"] / GIB
    measured = {"weights": readings["weights"] / GIB, "state": state, "activations": readings["peak"] / GIB - state,
                "peak": max(readings["peak"], readings["first_peak"]) / GIB}
    return {"measured": measured, "estimate": est,
            "ratio": {part: measured[part] / est[part] for part in ("state", "activations") if est[part]}}


def row(args, device_name: str, fixed: dict, widths: dict | None, padding: float, compiled: dict, memory: dict) -> str:
    """The printed table row: the original columns, then compiles, memory against the estimate, the drawn widths."""
    peak = memory["measured"]["peak"] if memory["measured"] else float("nan")
    cells = [device_name, f"{args.model} {args.workload}", " ".join(args.overrides) or "defaults",
             f"{fixed['median_s']:.3f} s", f"{fixed['tflops']:.2f} TFLOP/s",
             f"{fixed['pct_of_matmul']:.1f}% of {args.dtype} matmul {fixed['matmul_tflops']:.2f}",
             f"padding {100 * padding:.1f}%", f"peak {peak:.1f} GiB",
             f"{compiled['graphs']} graphs, {compiled['recompiles']} recompiles"]
    for part in ("state", "activations"):
        measured = f"{memory['measured'][part]:.2f}" if memory["measured"] else "-"
        ratio = f" ({memory['ratio'][part]:.2f}x)" if memory["ratio"] and part in memory["ratio"] else ""
        cells.append(f"{part} {measured} / est. {memory['estimate'][part]:.2f} GiB{ratio}")
    if widths:
        cells.append(f"drawn widths: {len(widths['step_s'])} steps, median {widths['median_s']:.3f} s, "
                     f"{widths['pct_of_matmul']:.1f}%, +{widths['new_graphs']} graphs")
    return "| " + " | ".join(cells) + " |"


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The options this benchmark and bench/trl_learner_step.py share: device, model, workload, prompt length."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--model", default="qwen2_5_1_5b_random", help="a conf/model file with random_init")
    parser.add_argument("--workload", default="16x8x512", help="prompts x samples x completion tokens")
    parser.add_argument("--prompt-tokens", type=int, default=44, help="tokens per prompt (compare_trl's: 44)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = workload_parser(__doc__)
    parser.add_argument("--steps", type=int, default=3, help="full-width steps; the first (compile) is dropped")
    parser.add_argument("--widths", type=int, default=0, metavar="N",
                        help="N more steps whose completion lengths are drawn from 1..T per sequence and step "
                             "(rows of other widths each step: does torch.compile recompile?); reported apart")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the learner's matmul dtype (autocast over fp32 weights) and the rate it is held to")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a hardware key over conf/hardware/<gpu|cpu>.yaml, e.g. attention=sdpa")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write every number here (scripts/gpu_check.py reads it)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.widths < 0:
        parser.error("--steps must be >= 1 and --widths >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = tuple(int(x) for x in args.workload.split("x"))
    hw = hardware_keys(args.device, args.overrides)
    if hw["compile_learner"] == "auto":  # a benchmark times the steady steps after the first, as of a long run
        hw["compile_learner"] = True
    cuda = args.device == "cuda"
    model = build_model(args.model, args.device, hw["attention"])
    readings = {"weights": torch.cuda.memory_allocated()} if cuda else {}
    settle_auto_layout(model, hw, args, cuda)
    if hw["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
    if hw["compile_learner"]:
        compile_decoder_layers(model, selective_checkpoint=kept_gib(hw) > 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def on_step(index: int) -> None:
        if not cuda:
            return
        if index == 0:  # weights, gradients (kept until the next step's zero_grad) and AdamW's moments
            readings.update(state=torch.cuda.memory_allocated(), first_peak=torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()  # the first step's peak holds the compile's autotuning too
        if index == max(args.steps - 1, 0):
            readings["peak"] = torch.cuda.max_memory_allocated() if args.steps > 1 else readings["first_peak"]

    steps = run_steps(model, optimizer, hw, args, workload, on_step)
    compiled = compile_stats()
    dtype = getattr(torch, args.dtype)
    rate = matmul_rate(args.device, dtype)
    fixed_steps = [s for s in steps if not s["varied"]]
    fixed = summary(fixed_steps[1:] or fixed_steps, rate) | {"matmul_tflops": rate / 1e12}
    widths = summary([s for s in steps if s["varied"]], rate) if args.widths else None
    p, g, t = workload
    widest = widest_micro_batch(model, batch(p, g, t, args.prompt_tokens, model.config.vocab_size), hw)
    memory = memory_report(readings, memory_estimate(model, hw, dtype, args.device, widest))
    memory["micro_batch_tokens"] = widest
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(row(args, device_name, fixed, widths, fixed_steps[-1]["padding_frac"], compiled, memory))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": device_name, "model": args.model, "workload": args.workload, "prompt_tokens": args.prompt_tokens,
            "dtype": args.dtype, "overrides": args.overrides, "hardware": {k: hw[k] for k in HW_KEYS},
            "fixed": fixed, "widths": widths, "padding_frac": fixed_steps[-1]["padding_frac"],
            "computed_tokens": fixed_steps[-1]["computed_tokens"], "flops_per_step": fixed_steps[-1]["flops"],
            "compile": compiled, "memory": memory}, indent=2))
    return 0


HW_KEYS = ("micro_batch_size", "micro_batch_tokens", "share_prompts", "attention", "compile_learner",
           "gradient_checkpointing", "keep_matmul_outputs_gib")


if __name__ == "__main__":
    sys.exit(main())
