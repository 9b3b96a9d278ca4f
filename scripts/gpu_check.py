"""Every GPU path fgrpo has, on one CUDA GPU, offline, with the machine's own torch: a markdown report of what ran,
what it gave and how long it took. ``scripts/gpu-check.sh`` runs it; see there for the options.

The checks are independent processes. The functional ones run side by side (one card, 16 cores: each is small),
then the benchmark against TRL runs alone, so that its timings are not shared with anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import functools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# a short run of the tiny random model on the GPU; the entropy bonus gives a random model's steps a gradient
RUN = ["model=tiny_random", "hardware=gpu", "sampler=hf", "logger=none", "trainer.steps=4",
       "trainer.prompts_per_step=4", "algo.group_size=4", "sampler.max_new_tokens=16", "eval.n_samples=4",
       "eval.max_problems=8", "eval.every=0", "algo.entropy_coef=0.01", "trainer.lr=1e-3",
       "trainer.checkpoint_every=1", "trainer.save_final=true"]
EVAL = ["model=tiny_random", "hardware=gpu", "sampler=hf", "logger=none", "eval.n_samples=16", "eval.max_problems=16"]
RARE_SET = REPO / "docs" / "results" / "arith_headroom" / "rare_set"  # SmolLM2's vocabulary, as tiny_random's


@dataclass
class Check:
    name: str
    what: str
    ok: bool | None = None  # None: skipped
    seconds: float = 0.0
    result: str = ""
    log: str = ""


@dataclass
class Context:
    out: Path
    deadline: float
    checks: list[Check] = field(default_factory=list)

    def logfile(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"


def run(ctx: Context, name: str, command: list[str], *, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """``command`` from the repository root, its output to logs/<name>.log; (exit code, the log's tail). 124: timed
    out (the whole process group killed)."""
    timeout = max(1.0, min(timeout, ctx.deadline - time.time()))
    log = ctx.logfile(name)
    with open(log, "a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(process)
            code = 124
    return code, log.read_text()[-2000:]


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def timed(ctx: Context, name: str, what: str, body) -> Check:
    """Run ``body() -> (ok, result)`` as one check of the report; an exception fails it with its message."""
    check = Check(name, what, log=str(ctx.logfile(name).relative_to(ctx.out)))
    started = time.time()
    try:
        check.ok, check.result = body()
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        check.ok, check.result = False, f"{type(exc).__name__}: {exc}"
    check.seconds = time.time() - started
    ctx.checks.append(check)
    print(f"[gpu-check] {name}: {'ok' if check.ok else 'skipped' if check.ok is None else 'FAILED'} "
          f"({check.seconds:.0f} s) {check.result}", file=sys.stderr, flush=True)
    return check


def last_line(text: str, pattern: str) -> str:
    lines = [line for line in text.splitlines() if re.search(pattern, line)]
    return lines[-1].strip() if lines else text.strip().splitlines()[-1] if text.strip() else ""


def pytest_gpu(ctx: Context):
    code, tail = run(ctx, "pytest-gpu", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
                     timeout=420)
    return code == 0, last_line(tail, r"passed|failed|error")


def train_run(ctx: Context, name: str, *extra: str, launcher: list[str] | None = None, timeout: float = 300,
              env: dict | None = None):
    run_dir = ctx.out / "runs" / name
    code, tail = run(ctx, name, [*(launcher or [PY]), "run.py", f"hydra.run.dir={run_dir}", *RUN, *extra],
                     timeout=timeout, env=env)
    summary = run_dir / "summary.json"
    if code != 0 or not summary.exists():
        return False, f"exit {code}: {first_error(ctx.logfile(name).read_text())}"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    learn = [r["perf/learn_time_s"] for r in steps if "perf/learn_time_s" in r]
    return True, f"{len(learn)} steps, learner {min(learn):.2f}-{max(learn):.2f} s per step"


def killed_and_resumed(ctx: Context, variant: str, *extra: str, env: dict | None = None):
    """The run killed with SIGKILL once step 2 is logged, then the same command again (runs/resumed<variant>)."""
    name = f"resumed{variant}"
    run_dir = ctx.out / "runs" / name
    command = [PY, "run.py", f"hydra.run.dir={run_dir}", *RUN, *extra]
    with open(ctx.logfile(name), "a") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
        metrics, deadline = run_dir / "metrics.jsonl", min(ctx.deadline, time.time() + 300)
        while process.poll() is None and time.time() < deadline:
            if metrics.exists() and '"step": 2' in metrics.read_text() and (run_dir / "checkpoints" / "latest").exists():
                break
            time.sleep(0.1)
        alive = process.poll() is None
        kill_group(process)
    if not alive:
        return False, "the run ended before it could be killed"
    code, tail = run(ctx, name, command, timeout=300, env=env)
    if code != 0:
        return False, f"the resumed run: exit {code}: {first_error(tail)}"
    resumed = last_line((run_dir / "run.log").read_text(), "resumed from").split("resumed from ")[-1]
    return True, f"killed after step 2 was logged; resumed from {Path(resumed.split(':')[0]).name}"


def same_final_weights(ctx: Context, variant: str):
    """The resumed run's final weights against the uninterrupted one's (runs/full<variant>), bitwise."""
    from safetensors.torch import load_file

    import torch

    full, resumed = (load_file(str(ctx.out / "runs" / f"{n}{variant}" / "final_model" / "model.safetensors"))
                     for n in ("full", "resumed"))
    differ = [k for k in full if k not in resumed or not torch.equal(full[k], resumed[k])]
    if not differ and full.keys() == resumed.keys():
        return True, f"all {len(full)} tensors bitwise equal"
    largest = max(float((full[k].float() - resumed[k].float()).abs().max()) for k in differ)
    return False, f"{len(differ)} of {len(full)} tensors differ (largest difference {largest:.2e})"


# resume pairs: the GPU defaults, and two variants that tell which part breaks a bitwise resume if one does
RESUME_VARIANTS = {
    "": (),
    "-eager-layers": ("hardware.compile_learner=false",),
    "-padded": ("hardware.attention=sdpa", "hardware.micro_batch_tokens=null", "hardware.share_prompts=false"),
}


def evaluate(ctx: Context, name: str, *extra: str):
    out = ctx.out / "eval" / name
    code, tail = run(ctx, f"evaluate-{name}", [PY, "-m", "fgrpo.evaluate", f"hydra.run.dir={out}", *EVAL, *extra],
                     timeout=240)
    if code != 0 or not (out / "eval_counts.jsonl").exists():
        return False, f"exit {code}: {first_error(tail)}"
    summary = json.loads((out / "summary.json").read_text())
    return True, ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in summary.items() if re.fullmatch(r"eval/pass@\d+", k))


def compare(ctx: Context):
    out = ctx.out / "compare.md"
    code, tail = run(ctx, "compare", [PY, "-m", "fgrpo.compare", str(ctx.out / "eval" / "base"),
                                      str(ctx.out / "eval" / "trained"), "--iterations", "200", "--out", str(out)],
                     timeout=120)
    if code != 0 or not out.exists():
        return False, f"exit {code}: {first_error(tail)}"
    return True, "k = 1: " + last_line(out.read_text(), r"^\| \S+ \| 1 \|")


def rare_nll(ctx: Context):
    out = ctx.out / "rare_nll.json"
    code, tail = run(ctx, "rare-nll", [PY, "-m", "fgrpo.rare_nll", "score", str(RARE_SET), str(ctx.out / "runs" / "full"),
                                       "--device", "cuda", "--out", str(out)], timeout=180)
    if code != 0 or not out.exists():
        return False, f"exit {code}: {first_error(tail)}"
    score = json.loads(out.read_text())
    return True, ", ".join(f"{k} {v:.3f}" for k, v in score.items() if isinstance(v, float))[:200]


def torchrun(ctx: Context, name: str, *extra: str):
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    return train_run(ctx, name, "hardware.fsdp=true", *extra, launcher=launcher)


def vllm_run(ctx: Context):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM is not installed here"
    return train_run(ctx, "vllm", "sampler=vllm")


def bench_model(ctx: Context):
    """The benchmark's model folder built now, beside the other checks, instead of inside the benchmark's time."""
    code, tail = run(ctx, "bench-model", [PY, "-c", BUILD_BENCH_MODEL], timeout=300)
    return code == 0, last_line(tail, "fgrpo") if code == 0 else f"exit {code}: {first_error(tail)}"


BENCH_MODEL = "qwen2_5_1_5b_random"
# the benchmark at 16x8x512, ours then TRL, 3 steps each: about 270 s on an H100 (the model folder built before)
BENCH_RESERVE_S = 290
BUILD_BENCH_MODEL = (
    "import sys; sys.path.insert(0, 'bench'); from compare_trl import compose_config; "
    "from fgrpo.learner.model import resolve_model_folder; "
    f"print(resolve_model_folder(compose_config(dict(workload=[1, 2, 1], model='{BENCH_MODEL}', steps=2, lr=1e-6, "
    "hardware='gpu')).model))")


def functional_checks(ctx: Context, with_bench_model: bool) -> None:
    """Side by side, in chains where one check needs another's output."""
    def chain_trained(env: dict):
        if timed(ctx, "run", "run.py hardware=gpu sampler=hf (4 steps, checkpoint each)",
                 lambda: train_run(ctx, "full", env=env)).ok:
            timed(ctx, "evaluate", "fgrpo.evaluate of the run on cuda", lambda: evaluate(ctx, "trained",
                  f"eval.model={ctx.out / 'runs' / 'full'}"))
            timed(ctx, "rare-nll", "fgrpo.rare_nll score on cuda", lambda: rare_nll(ctx))

    def chain_resume(variant: str, extra: tuple):
        # after its uninterrupted twin, as a crashed run is resumed on its machine: inductor's kernel choices (its
        # reduction kernels are timed at their first call) come from the twin's cache, of this pair alone
        env = {"TORCHINDUCTOR_CACHE_DIR": str(ctx.out / "inductor" / (variant or "defaults"))}
        if variant:
            timed(ctx, f"run{variant}", f"run.py hardware=gpu sampler=hf {' '.join(extra)}",
                  lambda: train_run(ctx, f"full{variant}", *extra, env=env))
        else:
            chain_trained(env)
        timed(ctx, f"resume{variant}", f"SIGKILL after step 2, the same command again {' '.join(extra)}",
              lambda: killed_and_resumed(ctx, variant, *extra, env=env))

    def chain_fsdp():
        timed(ctx, "torchrun-fsdp", "torchrun --nproc_per_node 1, hardware.fsdp=true (flex compiled alone)",
              lambda: torchrun(ctx, "torchrun-fsdp", "hardware.compile_learner=false"))
        timed(ctx, "torchrun-offload", "torchrun --nproc_per_node 1, hardware.fsdp=true hardware.cpu_offload=true",
              lambda: torchrun(ctx, "torchrun-offload", "hardware.cpu_offload=true", "hardware.compile_learner=false"))

    chains = [
        lambda: timed(ctx, "pytest-gpu", "pytest -m gpu (every test marked gpu)", lambda: pytest_gpu(ctx)),
        lambda: timed(ctx, "evaluate-base", "fgrpo.evaluate of the starting weights", lambda: evaluate(ctx, "base")),
        chain_fsdp,
    ] + [functools.partial(chain_resume, variant, extra) for variant, extra in RESUME_VARIANTS.items()] + (
        [lambda: timed(ctx, "bench-model", f"build the benchmark's {BENCH_MODEL} folder", lambda: bench_model(ctx))]
        if with_bench_model else [])
    with concurrent.futures.ThreadPoolExecutor(len(chains)) as pool:
        for future in [pool.submit(chain) for chain in chains]:
            future.result()
    # alone: vLLM profiles the card's free memory at start, which other processes' allocations would upset
    timed(ctx, "vllm", "run.py hardware=gpu sampler=vllm", lambda: vllm_run(ctx))
    passed = {c.name for c in ctx.checks if c.ok}
    for variant in RESUME_VARIANTS:
        if {f"run{variant}", f"resume{variant}"} <= passed:
            timed(ctx, f"resume-weights{variant}", "resumed final weights == uninterrupted",
                  lambda: same_final_weights(ctx, variant))
    if {"evaluate", "evaluate-base"} <= passed:
        timed(ctx, "compare", "fgrpo.compare base vs trained", lambda: compare(ctx))


def bench(ctx: Context, workloads: list[str], steps: int):
    command = [PY, "bench/compare_trl.py", "--hardware", "gpu", "--sampler", "hf", "--model", BENCH_MODEL,
               "--steps", str(steps), "--workdir", str(ctx.out / "bench"), "--out", str(ctx.out / "bench.md"),
               "--out", str(ctx.out / "bench.json")]
    for workload in workloads:
        command += ["--workload", workload]
    code, tail = run(ctx, "bench", command, timeout=ctx.deadline - time.time())
    table = ctx.out / "bench.md"
    return code == 0 and table.exists(), "see the benchmark below" if table.exists() else f"exit {code}"


def versions() -> str:
    import importlib.metadata as metadata

    import torch

    names = ("torch", "transformers", "triton", "vllm", "trl", "hydra-core")
    found = []
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{name} {metadata.version(name)}")
    cuda = torch.version.cuda or "none"
    return ", ".join(found) + f", CUDA {cuda}, Python {platform.python_version()}"


def report(ctx: Context, started: float) -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    lines = [f"# gpu-check {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}", "",
             f"- GPU: {gpu}" + (f" ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
                                if torch.cuda.is_available() else ""),
             f"- versions: {versions()}",
             f"- commit: {git_commit()}", f"- wall: {time.time() - started:.0f} s", "",
             "| check | what | result | time | detail |", "|---|---|---|---|---|"]
    for c in ctx.checks:
        state = "ok" if c.ok else "skipped" if c.ok is None else "**FAILED**"
        lines.append(f"| {c.name} | {c.what} | {state} | {c.seconds:.0f} s | {c.result.replace('|', '/')} |")
    table = ctx.out / "bench.md"
    if table.exists():
        lines += ["", "## Benchmark against TRL", "", table.read_text()]
    for c in ctx.checks:  # the report travels alone (a GPU lent for minutes): the failures' evidence goes in it
        log = ctx.out / c.log
        if c.ok is False and log.exists():
            lines += ["", f"## {c.name}: the end of {c.log}", "", "```", *error_tail(log.read_text()), "```"]
    return "\n".join(lines) + "\n"


def error_tail(text: str, keep: int = 20) -> list[str]:
    """A failed log's evidence: its first ``keep`` error lines (a launcher's traceback would bury the run's own
    message), then its last ``keep`` lines; progress bars left out, each line cut to 300 characters."""
    lines = [line[:300] for line in text.splitlines() if line.strip() and "it/s]" not in line]
    errors = [line for line in lines if ERROR_LINE.search(line)][:keep]
    return errors + ["..."] + lines[-keep:] if errors else lines[-keep:]


ERROR_LINE = re.compile(r"^(error: |E +|FAILED |[\w.]*(Error|Exception)\b)")


def first_error(text: str) -> str:
    """The first line that says what went wrong (fgrpo's ``error:`` line, an exception, a failed test)."""
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if ERROR_LINE.search(line)), None)
    if first is None:
        return last_line(text, "")
    return " / ".join(line.strip() for line in lines[first:first + 3])[:300]  # a message may go on below


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="report folder (default outputs/gpu-check/<date-time>)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for everything (default 540)")
    parser.add_argument("--workload", action="append", help="benchmark workload PxGxT (repeatable; default 16x8x512)")
    parser.add_argument("--bench-steps", type=int, default=3, help="benchmark steps per system (the first dropped)")
    parser.add_argument("--skip", action="append", default=[], choices=["functional", "bench"], help="leave a part out")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error("no CUDA device is visible: this checks the GPU paths (the CPU ones: bash scripts/test.sh)")
    out = args.out or REPO / "outputs" / "gpu-check" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.time()
    with_bench = "bench" not in args.skip
    # the benchmark's time is kept for it: the functional checks stop at the budget less that
    ctx = Context(out.resolve(), started + args.budget - (BENCH_RESERVE_S if with_bench else 0))
    if "functional" not in args.skip:
        functional_checks(ctx, with_bench_model=with_bench)
    ctx.deadline = started + args.budget
    if "bench" not in args.skip:
        timed(ctx, "bench", "bench/compare_trl.py --hardware gpu, ours then TRL",
              lambda: bench(ctx, args.workload or ["16x8x512"], args.bench_steps))
    text = report(ctx, started)
    (out / "report.md").write_text(text)
    print(text)
    return 0 if all(c.ok is not False for c in ctx.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
