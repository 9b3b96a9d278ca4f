"""Side-by-side benchmark: fgrpo's training loop against TRL's GRPOTrainer on the same work.

One invocation runs, for each workload ``PxGxT`` (prompts per step x samples per prompt x new tokens):

1. **ours**: ``fgrpo.train.train`` (vLLM sampler, learner with bf16 autocast where the CPU runs bf16 natively, else fp32;
   DAPO token-mean loss), and
2. **trl**: ``trl.GRPOTrainer`` (transformers ``generate``, fp32, ``loss_type="dapo"``, beta 0),

each in its own subprocess (vLLM changes process-wide torch state), on the same model folder, the
same arithmetic prompts in the same order, the same learning rate and clip range. The first step of
each is a warm-up and is dropped; the table shows medians of the rest, the phase split, tokens per
second, peak RSS, and each phase's share of the machine's measured matmul FLOP/s.

    python bench/compare_trl.py                                  # both workloads, bundled SmolLM2-135M
    python bench/compare_trl.py --workload 4x8x64 --steps 5 --out results.md
    python bench/compare_trl.py --model tiny_random --workload 2x2x8 --steps 2   # smoke run
    python bench/compare_trl.py --hardware gpu --sampler hf --model qwen2_5_1_5b_random   # one CUDA GPU
    python bench/compare_trl.py --lora 16 --workload 8x8x32 --lr 1e-4   # both train rank-16 LoRA adapters

``--lora R``: ours runs with ``model.lora.rank=R`` and TRL with a peft ``LoraConfig`` of the same rank, alpha 2R,
no dropout, on the same linear layers (every attention and MLP projection), its ``peft_config``.

TRL comes from the ``bench`` extra: ``pip install 'fgrpo[bench]'``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the children and the report live beside this file: importable when it runs as a script and when loaded by path
BENCH = str(Path(__file__).resolve().parent)
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from compare_trl_children import (  # noqa: E402
    REPO, TRL_MISSING, child_matmul, child_ours, child_trl, compose_config, package_version, trl_available,
)
from compare_trl_report import ROWS, SYSTEMS, markdown, precision_line, summarise  # noqa: E402

DEFAULT_WORKLOADS = ("4x8x64", "8x8x128")


# --------------------------------------------------------------------------------------------------
# workloads and matmul readings


def parse_workload(text: str) -> tuple[int, int, int]:
    """``"4x8x64"`` -> ``(prompts, group_size, max_new_tokens)``."""
    try:
        p, g, t = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"workload {text!r}: expected PxGxT, e.g. 4x8x64") from None
    if p < 1 or g < 2 or t < 1:
        raise argparse.ArgumentTypeError(f"workload {text!r}: need P >= 1, G >= 2, T >= 1")
    return p, g, t


def best_matmul(before: dict, after: dict) -> dict:
    """The better of two matmul measurements (before and after the runs), keeping both readings."""
    best = dict(before)
    for key in ("fp32_flops", "bf16_flops"):
        best[key] = max(before[key], after[key])
    best["readings"] = [{key: m[key] for key in ("fp32_flops", "bf16_flops")} for m in (before, after)]
    return best


# --------------------------------------------------------------------------------------------------
# parent: run children, watch memory, summarise


def _tree_rss_bytes(root: int) -> int:
    """RSS of ``root`` and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += [child for child, parent in parents.items() if parent == pid]
    return total


def run_child(mode: str, spec: dict, workdir: Path, log_path: Path, timeout_s: float) -> dict:
    """Run this script as ``--_child mode``; return its JSON result plus the polled peak RSS of its tree."""
    spec_path, result_path = workdir / f"{mode}-spec.json", workdir / f"{mode}-result.json"
    spec_path.write_text(json.dumps({**spec, "workdir": str(workdir)}))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    command = [sys.executable, str(Path(__file__).resolve()), "--_child", mode, "--_spec", str(spec_path),
               "--_result", str(result_path)]
    peak, start = 0, time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            peak = max(peak, _tree_rss_bytes(proc.pid))
            if time.monotonic() - start > timeout_s:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{mode} ran past {timeout_s:.0f} s; its log: {log_path}")
            time.sleep(0.25)
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["peak_rss_gib"] = max(peak / 2**30, result.get("peak_rss_child_gib", 0.0))
    return result


def machine_line(cpu: str | None = None) -> str:
    """``cpu``: fgrpo.infra.precision.describe_cpu() as a child saw it (name, instruction-set kind, torch's kernels)."""
    from fgrpo.infra.precision import describe_cpu

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu or describe_cpu()}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}"


def gpu_line() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def run_workloads(args, systems: list[str], workloads, matmul: dict, workdir: Path) -> dict:
    """Each workload, each system in its own child process: {name: {system: result or {"error": ...}}}."""
    workloads_run: dict = {}
    for p, g, t in workloads:
        name = f"{p}x{g}x{t}"
        entry: dict = {}
        for system in systems:
            spec = {"workload": [p, g, t], "steps": args.steps, "lr": args.lr, "model": args.model,
                    "hardware": args.hardware, "sampler": args.sampler, "overrides": args.overrides,
                    "trl_micro_batch": args.trl_micro_batch, "lora": args.lora}
            sub = workdir / name
            sub.mkdir(exist_ok=True)
            if args.profile and system == "ours":
                spec["profile"] = str(sub / f"{system}-learner-profile.txt")
            print(f"[{name}] running {system} ({args.steps} steps) ...", file=sys.stderr)
            started = time.perf_counter()
            try:
                result = run_child(system, spec, sub, sub / f"{system}.log", args.timeout)
            except RuntimeError as exc:  # e.g. killed for memory: report it, go on with the rest
                print(f"[{name}] {system} FAILED: {exc}", file=sys.stderr)
                entry[system] = {"error": str(exc).splitlines()[0]}
                continue
            result["wall_s"] = time.perf_counter() - started
            entry[system] = result
            print(f"[{name}] {system}: {summarise(result, p, g, matmul)['step_s']:.2f} s/step, "
                  f"wall {result['wall_s']:.0f} s", file=sys.stderr)
        workloads_run[name] = entry
    return workloads_run


def add_summaries(report: dict, systems: list[str], matmul: dict) -> None:
    """Each run's summary against the better matmul reading, and TRL / ours where both ran."""
    for name, entry in report["workloads"].items():
        p, g, _ = parse_workload(name)
        for system in systems:
            if "error" not in entry.get(system, {"error": None}):
                entry[system]["summary"] = summarise(entry[system], p, g, matmul)
        if all("summary" in entry.get(s, {}) for s in SYSTEMS):
            entry["ratio_trl_over_ours"] = {key: entry["trl"]["summary"][key] / entry["ours"]["summary"][key]
                                            for key, _, _ in ROWS
                                            if isinstance(entry["ours"]["summary"].get(key), (int, float))
                                            and entry["ours"]["summary"][key]
                                            and isinstance(entry["trl"]["summary"].get(key), (int, float))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", type=parse_workload, metavar="PxGxT",
                        help=f"prompts x samples x max new tokens; repeatable (default: {' and '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; the first is dropped (default 5)")
    parser.add_argument("--only", choices=SYSTEMS, help="run one system only")
    parser.add_argument("--model", default="smollm2_135m",
                        help="a conf/model name: smollm2_135m (the bundled model, default), tiny_random, or "
                             "qwen2_5_1_5b_random (Qwen2.5-1.5B's shape, random weights; for a GPU)")
    parser.add_argument("--hardware", choices=("cpu", "gpu"), default="cpu",
                        help="conf/hardware for ours (TRL follows its device, micro-batch, precision); default cpu")
    parser.add_argument("--sampler", choices=("vllm", "hf"),
                        help="conf/sampler for ours (default: the config's, auto: vllm where installed); hf = transformers "
                             "generate, as TRL")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for ours, e.g. hardware.micro_batch_size=16 (repeatable); TRL "
                             "follows hardware.micro_batch_size, and on a GPU hardware.gradient_checkpointing")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate for both (default 1e-6, TRL's default)")
    parser.add_argument("--out", type=Path, action="append", default=[], help="write the results: .json or .md (repeatable)")
    parser.add_argument("--workdir", type=Path, help="keep run directories and child logs here (default: a temp dir)")
    parser.add_argument("--profile", action="store_true",
                        help="profile our second learner step with torch.profiler (top ops to the workdir); that "
                             "step is left out of ours' statistics, so use --steps >= 3")
    parser.add_argument("--trl-micro-batch", type=int,
                        help="TRL's per-device batch (gradient accumulation up to P x G); default: ours' "
                             "hardware.micro_batch_size (32)")
    parser.add_argument("--lora", type=int, metavar="RANK",
                        help="both train LoRA adapters of this rank (alpha 2 x rank, every projection) instead of "
                             "every weight: ours model.lora.rank, TRL peft_config")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child run (default 3600)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args._child:
        spec = json.loads(Path(args._spec).read_text()) if args._spec else {}
        result = {"ours": child_ours, "trl": child_trl}[args._child](spec) if args._child != "matmul" \
            else child_matmul(spec.get("threads", 2), spec.get("device", "cpu"), spec.get("hardware"))
        Path(args._result).write_text(json.dumps(result))
        return 0

    if args.lora is not None and args.lora < 1:
        parser.error(f"--lora {args.lora}: a LoRA rank is >= 1")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up and is dropped)")
    for out in args.out:
        if out.suffix not in (".json", ".md"):
            parser.error(f"--out {out}: must end in .json or .md")
    systems = [args.only] if args.only else list(SYSTEMS)
    if "trl" in systems and not trl_available():
        if args.only == "trl":
            parser.error(TRL_MISSING)
        print(f"note: {TRL_MISSING}; running ours only", file=sys.stderr)
        systems = ["ours"]
    workloads = args.workload or [parse_workload(w) for w in DEFAULT_WORKLOADS]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fgrpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)

    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1
    device = "cuda" if args.hardware == "gpu" else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--hardware gpu: torch sees no CUDA device (use --hardware cpu)")
    print(f"measuring matmul FLOP/s on {threads} threads ..." if device == "cpu" else "measuring GPU matmul FLOP/s ...",
          file=sys.stderr)
    # ours' dtype keys as composed (auto, unless --set says otherwise): the matmul child settles them as the run will
    composed = compose_config({"workload": workloads[0], "model": args.model, "steps": args.steps, "lr": args.lr,
                               "hardware": args.hardware, "sampler": args.sampler, "overrides": args.overrides,
                               "lora": args.lora}).hardware
    matmul_spec = {"threads": threads, "device": device,
                   "hardware": {"autocast_dtype": composed.autocast_dtype, "sampler_dtype": composed.sampler_dtype}}
    matmul = run_child("matmul", matmul_spec, workdir, workdir / "matmul.log", args.timeout)
    print(f"precision: {precision_line(matmul)}", file=sys.stderr)
    gpu = gpu_line() if device == "cuda" else None
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(matmul.get("cpu")) + (f"; GPU {gpu}" if gpu else ""),
        "hardware": args.hardware, "sampler": args.sampler, "overrides": args.overrides,
        "versions": ", ".join(f"{name} {package_version(name)}" for name in ("torch", "vllm", "transformers", "trl"))
                    + f", python {platform.python_version()}",
        "model": args.model, "lr": args.lr, "steps": args.steps, "lora": args.lora, "matmul": matmul, "workloads": {},
    }
    report["workloads"] = run_workloads(args, systems, workloads, matmul, workdir)

    # the matmul rate moves by up to 1.6x between minutes on a shared 2-core VM: measure it again
    # after the runs and divide by the better reading, so no phase looks closer to the limit than it is
    print("measuring matmul FLOP/s again ...", file=sys.stderr)
    matmul = report["matmul"] = best_matmul(
        matmul, run_child("matmul", matmul_spec, workdir, workdir / "matmul-after.log", args.timeout))
    add_summaries(report, systems, matmul)

    table = markdown(report)
    print(table)
    for out in args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) if out.suffix == ".json" else table + "\n")
    print(f"run directories and logs: {workdir}", file=sys.stderr)
    failed = [f"{w}/{s}" for w, e in report["workloads"].items() for s in SYSTEMS if "error" in e.get(s, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
