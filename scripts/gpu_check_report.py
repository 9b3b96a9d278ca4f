"""The parts of scripts/gpu_check.py that judge and write, apart from what runs: each check's state, the resumed run
against its uninterrupted twin (weights, metrics step by step), the targets' pass/fail lines from the benchmarks'
JSON, the markdown report. Pure, and importable without a GPU (the tests run it on a CPU).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

OK, FAILED, OUT_OF_TIME, SKIPPED = "ok", "failed", "out of time", "skipped"
LABEL = {OK: "ok", FAILED: "**FAILED**", OUT_OF_TIME: "**out of time**", SKIPPED: "skipped"}

# the targets (issue 46): the learner's share of the card's bf16 matmul rate at Qwen2.5-1.5B's shape, its
# speed against TRL's learner on the same batch, and the memory estimate's error on each part
MIN_MATMUL_PCT = 35.0
MIN_SPEEDUP_OVER_TRL = 1.5
MEMORY_TOLERANCE = 0.15


@dataclass
class Check:
    name: str
    what: str
    state: str = SKIPPED
    seconds: float = 0.0
    box: float | None = None  # its time box, seconds
    result: str = ""
    log: str = ""


# --------------------------------------------------------------------------------------------------
# the resumed run against the uninterrupted one


def train_rows(path: Path) -> dict[int, dict]:
    """metrics.jsonl's training rows by step (evaluation rows, without a loss, left out; a later row of a step wins)."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "step" in row and "train/loss" in row:
            rows[int(row["step"])] = row
    return rows


def first_diverging_step(full: Path, resumed: Path, keys=("train/loss", "train/grad_norm")) -> tuple[int | None, str]:
    """The first step whose loss or gradient norm differs between two metrics.jsonl files (floats compared exactly:
    JSON keeps them to the last bit), or a step one of them lacks; (None, how many steps agree) where none does."""
    a, b = train_rows(full), train_rows(resumed)
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            return step, f"step {step} only in the {'uninterrupted' if step in a else 'resumed'} run"
        differ = [k for k in keys if a[step].get(k) != b[step].get(k)]
        if differ:
            return step, f"step {step}: " + ", ".join(f"{k.split('/')[-1]} {a[step].get(k)!r} vs {b[step].get(k)!r}"
                                                      for k in differ)
    return None, f"loss and grad_norm equal at all {len(a)} steps"


def compare_weights(full: Path, resumed: Path) -> dict:
    """Two safetensors files tensor by tensor: how many, how many differ (or are missing), the largest difference."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(full)), load_file(str(resumed))
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    largest = max((float((a[k].float() - b[k].float()).abs().max()) for k in differ if k in a and k in b), default=0.0)
    return {"tensors": len(a.keys() | b.keys()), "differ": len(differ), "largest": largest}


def resume_verdict(weights: dict, diverging: tuple[int | None, str], resumed_after: int | None) -> tuple[bool, str]:
    """ok when the final weights are bitwise equal; the text says by how much they are not and where the runs part."""
    step, detail = diverging
    if weights["differ"] == 0:
        text = f"bitwise equal ({weights['tensors']} tensors)"
    else:
        text = (f"NOT bitwise equal: {weights['differ']} of {weights['tensors']} tensors differ, largest absolute "
                f"difference {weights['largest']:.3e}")
    where = "first diverging step: none" if step is None else f"first diverging step {step}"
    if step is not None and resumed_after is not None:
        where += " (before the kill)" if step <= resumed_after else " (after the resume)"
    resumed = f"; resumed after step {resumed_after}" if resumed_after is not None else ""
    return weights["differ"] == 0, f"{text}; {where}: {detail}{resumed}"


def resumed_after_step(run_log: str) -> int | None:
    """The step fgrpo's resume line says was done ("resumed from ...: step 2 done, 2 to go")."""
    found = re.findall(r"resumed from .*?: step (\d+) done", run_log)
    return int(found[-1]) if found else None


# --------------------------------------------------------------------------------------------------
# targets


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def target_lines(learner: dict | None, trl: dict | None) -> list[str]:
    """One line per target: PASS, FAIL or not measured, with the numbers it was decided on."""
    def line(verdict: bool | None, what: str, numbers: str) -> str:
        return f"- **{'not measured' if verdict is None else 'PASS' if verdict else 'FAIL'}** {what}: {numbers}"

    lines = []
    fixed = (learner or {}).get("fixed")
    if fixed and learner.get("dtype") == "bfloat16":
        pct = fixed["pct_of_matmul"]
        lines.append(line(pct >= MIN_MATMUL_PCT, f"learner >= {MIN_MATMUL_PCT:.0f}% of the card's bf16 matmul rate",
                          f"{pct:.1f}% ({fixed['median_s']:.3f} s per step, {fixed['tflops']:.0f} of "
                          f"{fixed['matmul_tflops']:.0f} TFLOP/s; {learner['model']} {learner['workload']})"))
    else:
        lines.append(line(None, f"learner >= {MIN_MATMUL_PCT:.0f}% of the card's bf16 matmul rate",
                          "no bf16 learner benchmark"))
    same_batch = bool(learner and trl) and (learner["model"], learner["workload"]) == (trl["model"], trl["workload"])
    if fixed and same_batch:
        speedup = trl["median_s"] / fixed["median_s"]
        lines.append(line(speedup >= MIN_SPEEDUP_OVER_TRL, f"ours >= {MIN_SPEEDUP_OVER_TRL}x TRL's learner speed",
                          f"{speedup:.2f}x (TRL {trl['median_s']:.3f} s / ours {fixed['median_s']:.3f} s per step, "
                          f"TRL micro-batch {trl['micro_batch']} x {trl['accumulation']})"))
    else:
        lines.append(line(None, f"ours >= {MIN_SPEEDUP_OVER_TRL}x TRL's learner speed",
                          "needs both learner benchmarks on the same batch" + ("" if fixed else " (ours missing)")
                          + ("" if trl else " (TRL's missing)")))
    memory = (learner or {}).get("memory") or {}
    for part in ("state", "activations"):
        what = f"learner {part} within {MEMORY_TOLERANCE:.0%} of its estimate"
        if not memory.get("measured"):
            lines.append(line(None, what, "no CUDA memory reading"))
            continue
        measured, estimate = memory["measured"][part], memory["estimate"][part]
        ratio = measured / estimate if estimate else float("inf")
        lines.append(line(abs(ratio - 1) <= MEMORY_TOLERANCE, what,
                          f"measured {measured:.2f} GiB, estimate {estimate:.2f} GiB, ratio {ratio:.2f}"
                          + (f" (micro-batch of {memory['micro_batch_tokens']} token slots)"
                             if part == "activations" and memory.get("micro_batch_tokens") else "")))
    return lines


def learner_line(learner: dict) -> str:
    """bench/learner_step.py's JSON in one line, for the checks' table."""
    fixed, compiled, memory = learner["fixed"], learner["compile"], learner["memory"]
    text = (f"{fixed['median_s']:.3f} s per step, {fixed['pct_of_matmul']:.1f}% of {learner['dtype']} matmul; "
            f"{compiled['graphs']} graphs, {compiled['recompiles']} recompiles")
    if learner.get("widths"):
        widths = learner["widths"]
        text += f" (+{widths['new_graphs']} graphs in {len(widths['step_s'])} steps of drawn widths)"
    if memory.get("measured"):
        text += "; " + ", ".join(f"{part} {memory['measured'][part]:.2f} GiB (est. {memory['estimate'][part]:.2f})"
                                 for part in ("state", "activations"))
    return text


def trl_line(trl: dict) -> str:
    peak = f"; peak {trl['peak_gib']:.1f} GiB" if trl.get("peak_gib") else ""
    return (f"{trl['median_s']:.3f} s per step, {trl['pct_of_matmul']:.1f}% of {trl['dtype']} matmul; micro-batch "
            f"{trl['micro_batch']} x {trl['accumulation']}{peak}")


def benchmark_section(learner: dict | None, trl: dict | None) -> list[str]:
    """The learner benchmarks side by side, and the memory parts against their estimate."""
    if not learner and not trl:
        return []
    fixed, widths = (learner or {}).get("fixed") or {}, (learner or {}).get("widths")
    compiled, memory = (learner or {}).get("compile") or {}, (learner or {}).get("memory") or {}

    def cell(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = ["| | ours | TRL |", "|---|---|---|",
             f"| s per learner step (median) | {cell(fixed.get('median_s'), '.3f')} | "
             f"{cell((trl or {}).get('median_s'), '.3f')} |",
             f"| steps measured (s) | {fixed.get('step_s', '-')} | {(trl or {}).get('learn_s', [None, '-'])[1:]} |",
             f"| TFLOP/s | {cell(fixed.get('tflops'), '.1f')} | {cell((trl or {}).get('tflops'), '.1f')} |",
             f"| % of matmul | {cell(fixed.get('pct_of_matmul'), '.1f')} | "
             f"{cell((trl or {}).get('pct_of_matmul'), '.1f')} |",
             f"| peak GPU GiB | {cell((memory.get('measured') or {}).get('peak'), '.1f')} | "
             f"{cell((trl or {}).get('peak_gib'), '.1f')} |",
             f"| torch.compile graphs / recompiles | {compiled.get('graphs', '-')} / {compiled.get('recompiles', '-')} "
             f"({cell(compiled.get('compile_s'), '.0f')} s) | - |"]
    if widths:
        lines.append(f"| drawn widths: {len(widths['step_s'])} steps (s), graphs added | {widths['step_s']}, "
                     f"+{widths['new_graphs']} | - |")
    if compiled.get("recompile_reasons"):
        lines += ["", "Recompiles: " + "; ".join(r[:200] for r in compiled["recompile_reasons"])]
    if memory.get("measured"):
        lines += ["", "| memory part | measured GiB | estimate GiB | measured / estimate |", "|---|---|---|---|"]
        for part in ("weights", "state", "activations"):
            measured, estimate = memory["measured"][part], memory["estimate"][part]
            lines.append(f"| {part} | {measured:.2f} | {estimate:.2f} | {measured / estimate:.2f} |")
    return lines


# --------------------------------------------------------------------------------------------------
# logs and the report


ERROR_LINE = re.compile(r"^(error: |E +|FAILED |[\w.]*(Error|Exception)\b)")


def last_line(text: str, pattern: str) -> str:
    lines = [line for line in text.splitlines() if re.search(pattern, line)]
    return lines[-1].strip() if lines else text.strip().splitlines()[-1] if text.strip() else ""


def error_tail(text: str, keep: int = 20) -> list[str]:
    """A failed log's evidence: its first ``keep`` error lines (a launcher's traceback would bury the run's own
    message), then its last ``keep`` lines; progress bars left out, each line cut to 300 characters."""
    lines = [line[:300] for line in text.splitlines() if line.strip() and "it/s]" not in line]
    errors = [line for line in lines if ERROR_LINE.search(line)][:keep]
    return errors + ["..."] + lines[-keep:] if errors else lines[-keep:]


def first_error(text: str) -> str:
    """The first line that says what went wrong (fgrpo's ``error:`` line, an exception, a failed test)."""
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if ERROR_LINE.search(line)), None)
    if first is None:
        return last_line(text, "")
    return " / ".join(line.strip() for line in lines[first:first + 3])[:300]  # a message may go on below


def render_report(title: str, facts: list[str], checks: list[Check], out: Path, learner: dict | None = None,
                  trl: dict | None = None) -> str:
    """The markdown report: facts (GPU, versions, ...), each check's state, the targets, the benchmarks, and the end
    of each failed or timed-out check's log (the report travels alone: a GPU is lent for minutes)."""
    lines = [f"# {title}", "", *(f"- {fact}" for fact in facts), "",
             "| check | what | result | time (box) | detail |", "|---|---|---|---|---|"]
    for c in checks:
        box = f" ({c.box:.0f} s)" if c.box else ""
        lines.append(f"| {c.name} | {c.what} | {LABEL[c.state]} | {c.seconds:.0f} s{box} | "
                     f"{c.result.replace('|', '/')} |")
    lines += ["", "## Targets", "", *target_lines(learner, trl)]
    bench = benchmark_section(learner, trl)
    if bench:
        lines += ["", "## Learner benchmark" + (f" ({learner['model']} {learner['workload']})" if learner else ""),
                  "", *bench]
    for c in checks:
        log = out / c.log if c.log else None
        if c.state in (FAILED, OUT_OF_TIME) and log and log.is_file():
            lines += ["", f"## {c.name} ({c.state}): the end of {c.log}", "", "```", *error_tail(log.read_text()),
                      "```"]
    return "\n".join(lines) + "\n"
