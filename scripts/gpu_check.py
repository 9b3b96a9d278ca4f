"""Every GPU path fgrpo has, on one CUDA GPU, offline, with the machine's own torch, within a time budget (default
420 s): a markdown report of what ran, what it gave and how long it took. ``scripts/gpu-check.sh`` runs it.

The checks are independent processes, in order of priority, each with a time box: one that outlives its box is
killed and reported "out of time" (apart from one that failed, and one skipped: not started, for want of time or
of what it needs). 1. the resume pairs (hardware.deterministic=true, and the defaults) side by side: an
uninterrupted run, then the same run killed with SIGKILL after step 2 and resumed, its final weights and its
metrics compared with the twin's; 2. alone on the card, the learner benchmark (bench/learner_step.py) and TRL's
learner on the same batch (bench/trl_learner_step.py), which decide the targets; 3. as time allows, side by side:
pytest -m gpu, torchrun with FSDP and with CPU offload, fgrpo.evaluate, fgrpo.compare, fgrpo.rare_nll.
The judging and the report: scripts/gpu_check_report.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import importlib.util
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_report import (  # noqa: E402
    FAILED, LABEL, OK, OUT_OF_TIME, SKIPPED, Check, compare_weights, first_diverging_step, first_error, last_line,
    learner_line, read_json, render_report, resume_verdict, resumed_after_step, trl_line,
)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# a short run of the tiny random model on the GPU; the entropy bonus gives a random model's steps a gradient
RUN = ["model=tiny_random", "hardware=gpu", "sampler=hf", "logger=none", "trainer.steps=4",
       "trainer.prompts_per_step=4", "algo.group_size=4", "sampler.max_new_tokens=16", "eval.n_samples=4",
       "eval.max_problems=8", "eval.every=0", "algo.entropy_coef=0.01", "trainer.lr=1e-3",
       "trainer.checkpoint_every=1", "trainer.save_final=true"]
EVAL = ["model=tiny_random", "hardware=gpu", "sampler=hf", "logger=none", "eval.n_samples=16", "eval.max_problems=16"]
RARE_SET = REPO / "docs" / "results" / "arith_headroom" / "rare_set"  # SmolLM2's vocabulary, as tiny_random's
# the resume pairs, in order: with deterministic kernels (bitwise equality expected), and the GPU defaults
RESUME_VARIANTS = {"deterministic": ("hardware.deterministic=true",), "defaults": ()}
BENCH_MODEL = "qwen2_5_1_5b_random"
# time boxes, seconds. Basis: the 2026-11-26 H100 check, seven chains side by side (a tiny_random run 57 s, 24.5 s
# of it the compile; the kill and resume 88 s; torchrun 50 s; evaluate 19-28 s; pytest -m gpu 199 s), and TRL's
# learner at 16x8x512: 4.1 s per step. Expected here: a resume pair 110-145 s, the learner benchmark 70-100 s
# (about 45 s of compile, 4 + 3 steps of 1.5-4 s), TRL's 40-60 s.
BOX = {"run": 120, "resume": 150, "resume-equal": 60, "bench-learner": 150, "bench-trl": 120,
       "bench-learner-auto": 90, "evaluate": 90,
       "rare-nll": 90, "compare": 60, "torchrun": 120, "vllm": 150, "pytest-gpu": 600, "lora": 120}
# the learner with the layout sized from the card's memory (hardware auto keys), beside the fixed defaults
AUTO_LAYOUT = ("micro_batch_tokens=auto", "keep_matmul_outputs_gib=auto")
BENCH_RESERVE_S = 200  # kept for the benchmarks after the resume pairs: what they are expected to take, and margin
MIN_START_S = 10  # a check with less time left than this is not started
# the report's order: by priority
ORDER = [f"{kind}-{v}" for v in RESUME_VARIANTS for kind in ("run", "resume", "resume-equal")] + [
    "bench-learner", "bench-trl", "torchrun-fsdp", "torchrun-offload", "pytest-gpu", "evaluate-base",
    "evaluate-trained", "rare-nll", "compare", "bench-learner-auto", "vllm"]
# what the check decides: out of time there is exit status 2
PRIORITY = set(ORDER[:ORDER.index("bench-trl") + 1])


class OutOfTime(Exception):
    """A check's command ran past its time box (it was killed)."""


@dataclass
class Context:
    out: Path
    deadline: float  # the current phase's end: no check's box reaches past it
    checks: list[Check] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def logfile(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"


def run(ctx: Context, name: str, command: list[str], until: float, env: dict | None = None) -> tuple[int, str]:
    """``command`` from the repository root, its output to logs/<name>.log; (exit code, the log's tail). Past
    ``until`` the whole process group is killed and OutOfTime raised."""
    log = ctx.logfile(name)
    with open(log, "a") as out:
        out.write("$ " + " ".join(map(str, command)) + "\n")
        out.flush()
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
        try:
            code = process.wait(timeout=max(0.0, until - time.time()))
        except subprocess.TimeoutExpired:
            kill_group(process)
            raise OutOfTime(f"killed at its time box; last line: {last_line(log.read_text(), '')[:200]}") from None
    return code, log.read_text()[-2000:]


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def timed(ctx: Context, name: str, what: str, box: float, body) -> Check:
    """Run ``body(until) -> (ok, result)`` as one check of the report, within ``box`` seconds and the phase's end:
    OutOfTime marks it out of time, any other exception failed; with under MIN_START_S left in the phase it is not
    started."""
    started = time.time()
    until = min(started + box, ctx.deadline)
    if ctx.deadline - started < MIN_START_S:
        return skip(ctx, name, what, "not started: no time left in the budget")
    check = Check(name, what, box=until - started, log=str(ctx.logfile(name).relative_to(ctx.out)))
    try:
        ok, check.result = body(until)
        check.state = SKIPPED if ok is None else OK if ok else FAILED
    except OutOfTime as exc:
        check.state, check.result = OUT_OF_TIME, f"ran past {check.box:.0f} s: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        check.state, check.result = FAILED, f"{type(exc).__name__}: {exc}"
    check.seconds = time.time() - started
    return record(ctx, check)


def skip(ctx: Context, name: str, what: str, reason: str) -> Check:
    return record(ctx, Check(name, what, SKIPPED, result=reason))


def record(ctx: Context, check: Check) -> Check:
    with ctx.lock:
        ctx.checks.append(check)
    box = f" of {check.box:.0f}" if check.box else ""
    print(f"[gpu-check] {check.name}: {LABEL[check.state].strip('*')} ({check.seconds:.0f} s{box}) {check.result}",
          file=sys.stderr, flush=True)
    return check


# --------------------------------------------------------------------------------------------------
# the checks


def train_run(ctx: Context, until: float, name: str, *extra: str, launcher: list[str] | None = None,
              env: dict | None = None):
    run_dir = ctx.out / "runs" / name
    code, tail = run(ctx, name, [*(launcher or [PY]), "run.py", f"hydra.run.dir={run_dir}", *RUN, *extra], until,
                     env=env)
    if code != 0 or not (run_dir / "summary.json").exists():
        return False, f"exit {code}: {first_error(ctx.logfile(name).read_text())}"
    import json

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    learn = [r["perf/learn_time_s"] for r in steps if "perf/learn_time_s" in r]
    return True, f"{len(learn)} steps, learner {min(learn):.2f}-{max(learn):.2f} s per step"


def killed_and_resumed(ctx: Context, until: float, variant: str, *extra: str, env: dict | None = None):
    """The run killed with SIGKILL once step 2 is logged and checkpointed, then the same command again
    (runs/resumed-<variant>)."""
    name = f"resume-{variant}"
    run_dir = ctx.out / "runs" / name
    command = [PY, "run.py", f"hydra.run.dir={run_dir}", *RUN, *extra]
    with open(ctx.logfile(name), "a") as out:
        out.write("$ " + " ".join(command) + "  # killed once step 2 is logged\n")
        out.flush()
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
        metrics, latest = run_dir / "metrics.jsonl", run_dir / "checkpoints" / "latest"
        while process.poll() is None and time.time() < until:
            if metrics.exists() and '"step": 2' in metrics.read_text() and latest.exists():
                break
            time.sleep(0.1)
        alive, late = process.poll() is None, time.time() >= until
        kill_group(process)
    if late:
        raise OutOfTime("step 2 was not logged in time")
    if not alive:
        return False, f"the run ended (exit {process.returncode}) before it could be killed"
    code, tail = run(ctx, name, command, until, env=env)
    if code != 0:
        return False, f"the resumed run: exit {code}: {first_error(tail)}"
    return True, f"killed after step 2; resumed after step {resumed_after_step((run_dir / 'run.log').read_text())}"


def resume_equal(ctx: Context, variant: str):
    """The resumed run against its uninterrupted twin: final weights bitwise, metrics step by step."""
    full, resumed = (ctx.out / "runs" / f"{kind}-{variant}" for kind in ("run", "resume"))
    weights = compare_weights(*(d / "final_model" / "model.safetensors" for d in (full, resumed)))
    diverging = first_diverging_step(full / "metrics.jsonl", resumed / "metrics.jsonl")
    return resume_verdict(weights, diverging, resumed_after_step((resumed / "run.log").read_text()))


def resume_pair(ctx: Context, variant: str, extra: tuple) -> None:
    """The twin, then the kill and resume after it has finished, as a crashed run is resumed on its machine:
    inductor's kernel choices (a reduction's are timed at its first call) come from the twin's cache, this pair's."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(ctx.out / "inductor" / variant)}
    settings = " ".join(extra) or "the defaults"
    twin = timed(ctx, f"run-{variant}", f"run.py hardware=gpu sampler=hf, {settings}: 4 steps, a checkpoint each",
                 BOX["run"], lambda until: train_run(ctx, until, f"run-{variant}", *extra, env=env))
    what = f"{settings}: SIGKILL after step 2, the same command again"
    if twin.state != OK:
        skip(ctx, f"resume-{variant}", what, "its uninterrupted twin did not finish")
        return
    resumed = timed(ctx, f"resume-{variant}", what, BOX["resume"],
                    lambda until: killed_and_resumed(ctx, until, variant, *extra, env=env))
    what = f"{settings}: resumed == uninterrupted (final weights bitwise; loss, grad_norm step by step)"
    if resumed.state == OK:
        timed(ctx, f"resume-equal-{variant}", what, BOX["resume-equal"], lambda until: resume_equal(ctx, variant))
    else:
        skip(ctx, f"resume-equal-{variant}", what, "the killed run's resume did not finish")


def bench_learner(ctx: Context, until: float, workload: str, steps: int, widths: int, *overrides: str,
                  name: str = "learner"):
    out = ctx.out / "bench" / f"{name}.json"
    command = [PY, "bench/learner_step.py", "--device", "cuda", "--model", BENCH_MODEL, "--workload", workload,
               "--steps", str(steps), "--widths", str(widths), "--json", str(out)]
    for override in overrides:
        command += ["--set", override]
    code, tail = run(ctx, f"bench-{name}", command, until,
                     env={"TORCHINDUCTOR_CACHE_DIR": str(ctx.out / "inductor" / "bench")})
    if code != 0 or not out.exists():
        return False, f"exit {code}: {first_error(tail)}"
    return True, learner_line(read_json(out))


def bench_trl(ctx: Context, until: float, workload: str, steps: int):
    if importlib.util.find_spec("trl") is None:
        return None, "TRL is not installed here (../shared/gpu-carry.sh carries it)"
    out = ctx.out / "bench" / "trl.json"
    command = [PY, "bench/trl_learner_step.py", "--device", "cuda", "--model", BENCH_MODEL, "--workload", workload,
               "--steps", str(steps), "--json", str(out)]
    code, tail = run(ctx, "bench-trl", command, until)
    if code != 0 or not out.exists():
        return False, f"exit {code}: {first_error(tail)}"
    return True, trl_line(read_json(out))


def pytest_gpu(ctx: Context, until: float):
    command = [PY, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "tests"]
    try:
        code, tail = run(ctx, "pytest-gpu", command, until)
    except OutOfTime:
        log = ctx.logfile("pytest-gpu").read_text()
        counts = {word: len(re.findall(rf" {word.upper()}\b", log)) for word in ("passed", "failed", "error")}
        raise OutOfTime(", ".join(f"{n} {word}" for word, n in counts.items()) + " before the kill") from None
    return code == 0, last_line(tail, r"passed|failed|error")


def evaluate(ctx: Context, until: float, name: str, *extra: str):
    out = ctx.out / "eval" / name
    code, tail = run(ctx, f"evaluate-{name}", [PY, "-m", "fgrpo.evaluate", f"hydra.run.dir={out}", *EVAL, *extra],
                     until)
    if code != 0 or not (out / "eval_counts.jsonl").exists():
        return False, f"exit {code}: {first_error(tail)}"
    summary = read_json(out / "summary.json") or {}
    return True, ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in summary.items()
                           if re.fullmatch(r"eval/pass@\d+", k))


def compare(ctx: Context, until: float):
    out = ctx.out / "compare.md"
    code, tail = run(ctx, "compare", [PY, "-m", "fgrpo.compare", str(ctx.out / "eval" / "base"),
                                      str(ctx.out / "eval" / "trained"), "--iterations", "200", "--out", str(out)],
                     until)
    if code != 0 or not out.exists():
        return False, f"exit {code}: {first_error(tail)}"
    return True, "k = 1: " + last_line(out.read_text(), r"^\| \S+ \| 1 \|")


def rare_nll(ctx: Context, until: float):
    out = ctx.out / "rare_nll.json"
    code, tail = run(ctx, "rare-nll", [PY, "-m", "fgrpo.rare_nll", "score", str(RARE_SET),
                                       str(ctx.out / "runs" / "run-defaults"), "--device", "cuda", "--out", str(out)],
                     until)
    if code != 0 or not out.exists():
        return False, f"exit {code}: {first_error(tail)}"
    score = read_json(out) or {}
    return True, ", ".join(f"{k} {v:.3f}" for k, v in score.items() if isinstance(v, float))[:200]


def torchrun(ctx: Context, until: float, name: str, *extra: str):
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    return train_run(ctx, until, name, "hardware.fsdp=true", "hardware.compile_learner=false", *extra,
                     launcher=launcher)


def vllm_run(ctx: Context, until: float):
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM is not installed here"
    return train_run(ctx, until, "vllm", "sampler=vllm")


# --------------------------------------------------------------------------------------------------
# the phases


def side_by_side(*chains) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(chains)) as pool:
        for future in [pool.submit(chain) for chain in chains]:
            future.result()


def resume_phase(ctx: Context) -> None:
    """The resume pairs, side by side (each small, each with an inductor cache of its own)."""
    side_by_side(*(lambda v=v, extra=extra: resume_pair(ctx, v, extra) for v, extra in RESUME_VARIANTS.items()))


def bench_phase(ctx: Context, args) -> None:
    """Alone on the card, one after the other: their times and memory are theirs only."""
    timed(ctx, "bench-learner", f"bench/learner_step.py {BENCH_MODEL} {args.workload}: {args.bench_steps} steps "
          f"(the first dropped), then {args.widths} of drawn widths", BOX["bench-learner"],
          lambda until: bench_learner(ctx, until, args.workload, args.bench_steps, args.widths))
    timed(ctx, "bench-trl", f"bench/trl_learner_step.py: TRL's learner on the same batch, {args.trl_steps} steps",
          BOX["bench-trl"], lambda until: bench_trl(ctx, until, args.workload, args.trl_steps))


def bench_auto(ctx: Context, args) -> None:
    """Alone, after the optional checks: the layout sized from the card's memory (micro-batch tokens, kept matmul
    outputs) against the fixed defaults of bench-learner."""
    timed(ctx, "bench-learner-auto", f"bench/learner_step.py as bench-learner with {' '.join(AUTO_LAYOUT)}: 3 steps",
          BOX["bench-learner-auto"], lambda until: bench_learner(ctx, until, args.workload, 3, 0, *AUTO_LAYOUT,
                                                                 name="learner-auto"))


def lora_run(ctx: Context) -> None:
    """A short run with LoRA adapters (the packed GPU learner, the merged push); skipped where peft is missing."""
    if importlib.util.find_spec("peft") is None:
        skip(ctx, "run-lora", "run.py hardware=gpu model.lora.rank=16", "peft is not installed here: "
             "bash scripts/gpu-carry-lora.sh beside ../shared/gpu-carry.sh adds its wheel to .gpu-carry")
        return
    timed(ctx, "run-lora", "run.py hardware=gpu model.lora.rank=16 (the packed GPU learner with adapters)",
          BOX["lora"], lambda until: train_run(ctx, until, "run-lora", "model.lora.rank=16"))


def optional_phase(ctx: Context) -> None:
    """What time is left: the gpu tests and the other entry points on cuda, side by side."""
    def passed() -> set[str]:
        return {c.name for c in ctx.checks if c.state == OK}

    def on_the_trained_run():
        if "run-defaults" not in passed():
            for name in ("evaluate-trained", "rare-nll"):
                skip(ctx, name, "on runs/run-defaults", "run-defaults did not finish")
            return
        timed(ctx, "evaluate-trained", "fgrpo.evaluate of runs/run-defaults on cuda", BOX["evaluate"],
              lambda until: evaluate(ctx, until, "trained", f"eval.model={ctx.out / 'runs' / 'run-defaults'}"))
        timed(ctx, "rare-nll", "fgrpo.rare_nll score of runs/run-defaults on cuda", BOX["rare-nll"],
              lambda until: rare_nll(ctx, until))

    def sharded():
        timed(ctx, "torchrun-fsdp", "torchrun --nproc_per_node 1, hardware.fsdp=true (flex compiled alone)",
              BOX["torchrun"], lambda until: torchrun(ctx, until, "torchrun-fsdp"))
        timed(ctx, "torchrun-offload", "torchrun --nproc_per_node 1, hardware.fsdp=true hardware.cpu_offload=true",
              BOX["torchrun"], lambda until: torchrun(ctx, until, "torchrun-offload", "hardware.cpu_offload=true"))

    side_by_side(
        sharded,  # the offload run failed on the first GPU check: first in line
        lambda: timed(ctx, "pytest-gpu", "pytest -m gpu (every test marked gpu)", BOX["pytest-gpu"],
                      lambda until: pytest_gpu(ctx, until)),
        lambda: timed(ctx, "evaluate-base", "fgrpo.evaluate of the starting weights on cuda", BOX["evaluate"],
                      lambda until: evaluate(ctx, until, "base")),
        on_the_trained_run,
        lambda: lora_run(ctx))
    if {"evaluate-base", "evaluate-trained"} <= passed():
        timed(ctx, "compare", "fgrpo.compare base vs trained", BOX["compare"], lambda until: compare(ctx, until))
    # alone: vLLM measures the card's free memory at start, which other processes' allocations would upset
    timed(ctx, "vllm", "run.py hardware=gpu sampler=vllm", BOX["vllm"], lambda until: vllm_run(ctx, until))


# --------------------------------------------------------------------------------------------------
# the report


def versions() -> str:
    import importlib.metadata as metadata

    import torch

    found = []
    for name in ("torch", "transformers", "triton", "vllm", "trl", "hydra-core"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{name} {metadata.version(name)}")
    return ", ".join(found) + f", CUDA {torch.version.cuda or 'none'}, Python {platform.python_version()}"


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty else "")


def report(ctx: Context, started: float, budget: float) -> str:
    import torch

    gpu = torch.cuda.get_device_name()
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    facts = [f"GPU: {gpu} ({memory:.0f} GiB)", f"versions: {versions()}", f"commit: {git_commit()}",
             f"wall: {time.time() - started:.0f} s of a {budget:.0f} s budget"]
    checks = sorted(ctx.checks, key=lambda c: ORDER.index(c.name) if c.name in ORDER else len(ORDER))
    title = f"gpu-check {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
    return render_report(title, facts, checks, ctx.out, read_json(ctx.out / "bench" / "learner.json"),
                         read_json(ctx.out / "bench" / "trl.json"))


def exit_code(checks: list[Check]) -> int:
    """1: a check failed; 2: none failed, but one of the resume pairs or benchmarks (what the check decides) ran out of
    time or was not started for want of it; 0: else (the optional checks' time is what is left: theirs are in the
    report)."""
    if any(c.state == FAILED for c in checks):
        return 1
    short = any(c.name in PRIORITY and (c.state == OUT_OF_TIME or c.result.endswith("no time left in the budget"))
                for c in checks)
    return 2 if short else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Writes OUT/report.md (each check's state: ok, FAILED, out of time, skipped; the targets' PASS/FAIL\n"
               "lines; the learner benchmarks), each check's log in OUT/logs/, the benchmarks' numbers in\n"
               "OUT/bench/*.json. Exit 0: nothing failed, and the resume pairs and benchmarks ran; 1: a check\n"
               "failed; 2: a resume pair or benchmark ran out of time or found no time left.")
    parser.add_argument("out", type=Path, nargs="?", help="report folder (default outputs/gpu-check/<date-time>)")
    parser.add_argument("--budget", type=float, default=420,
                        help="seconds for everything (default 420: 7 minutes, two tries in a 15-minute lease)")
    parser.add_argument("--workload", default="16x8x512", help="the benchmarks' PxGxT (default 16x8x512)")
    parser.add_argument("--bench-steps", type=int, default=4,
                        help="our learner's full-width steps, the first dropped (default 4)")
    parser.add_argument("--widths", type=int, default=3, help="then its steps of drawn widths: recompiles? (default 3)")
    parser.add_argument("--trl-steps", type=int, default=3, help="TRL's learner's steps, the first dropped (default 3)")
    parser.add_argument("--skip", action="append", default=[], choices=["functional", "bench"],
                        help="leave a part out: functional (the resume pairs and the rest), bench (both learners)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error("no CUDA device is visible: this checks the GPU paths (the CPU ones: bash scripts/test.sh)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = (args.out or REPO / "outputs" / "gpu-check" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for stale in (out / "bench" / f"{name}.json" for name in ("learner", "trl", "learner-auto")):
        stale.unlink(missing_ok=True)
    started = time.time()
    end = started + args.budget
    functional, bench = "functional" not in args.skip, "bench" not in args.skip
    # the benchmarks' expected time is kept for them: the resume pairs stop that much before the budget's end
    ctx = Context(out, end - (BENCH_RESERVE_S if bench else 0))
    if functional:
        resume_phase(ctx)
    ctx.deadline = end
    if bench:
        bench_phase(ctx, args)
    if functional:
        optional_phase(ctx)
    if bench:
        bench_auto(ctx, args)
    text = report(ctx, started, args.budget)
    (out / "report.md").write_text(text)
    print(text)
    return exit_code(ctx.checks)


if __name__ == "__main__":
    sys.exit(main())
