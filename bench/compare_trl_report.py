"""bench/compare_trl.py's summary of each run and its markdown table: medians, tokens/s, shares of matmul FLOP/s."""

from __future__ import annotations

import statistics

SYSTEMS = ("ours", "trl")  # the table's column order


def summarise(result: dict, p: int, g: int, matmul: dict) -> dict:
    """Medians over the measured steps (the first is dropped), tokens/s and FLOP/s fractions."""
    # drop the warm-up step, and the profiled step (the profiler slows it down)
    drop = {0, result.get("profiled_step", -1)}
    steps = [s for i, s in enumerate(result["steps"]) if i not in drop] or result["steps"][-1:]
    med = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    body, head = result["params"]["body"], result["params"]["head"]
    # per step: prompt tokens count once per sample (what both samplers prefill without prefix sharing)
    prompt_per_sample = med["prompt_tokens"] / (p * g)
    gen = med["generated_tokens"]
    # the positions the learner's forward and backward ran over: ours leaves padding out and may compute a
    # group's shared prompt once (perf/learner_computed_tokens); TRL: every sample's prompt + completion
    computed = med.get("computed_tokens", med["prompt_tokens"] + gen)
    sampler_flops = 2 * body * (med["prompt_tokens"] + gen) + 2 * head * (gen + p * g)
    # forward 2, backward 4 per weight; with LoRA the frozen weights get no gradient of their own (backward 2), and
    # the adapters' own matmuls (rank r against the hidden size) are left out
    learner_flops = (4 if result.get("lora") else 6) * (body * computed + head * gen)
    out = {
        "step_s": med["step_s"], "sample_s": med["sample_s"], "score_s": med["score_s"], "learn_s": med["learn_s"],
        "other_s": med["other_s"], "generated_tokens": gen, "prompt_tokens_per_sample": prompt_per_sample,
        "sampler_tok_s": statistics.median(s["generated_tokens"] / max(s["sample_s"], 1e-9) for s in steps),
        "learner_tok_s": statistics.median((s["generated_tokens"] + s["prompt_tokens"]) / max(s["learn_s"], 1e-9)
                                           for s in steps),
        "sampler_gflop_s": sampler_flops / max(med["sample_s"], 1e-9) / 1e9,
        "learner_gflop_s": learner_flops / max(med["learn_s"], 1e-9) / 1e9,
        "peak_rss_gib": result["peak_rss_gib"], "peak_gpu_gib": result.get("peak_gpu_gib"),
        "measured_steps": len(steps),
        "learner_padding_pct": 100 * med["padding_frac"] if "padding_frac" in med else None,
        "learner_computed_tokens": computed,
        "learner_matmuls_kept_pct": 100 * med["matmuls_kept_frac"] if "matmuls_kept_frac" in med else None,
    }
    for phase in ("sampler", "learner"):
        for dtype in ("bf16", "fp32"):
            out[f"{phase}_pct_{dtype}"] = 100 * out[f"{phase}_gflop_s"] * 1e9 / matmul[f"{dtype}_flops"]
        if matmul.get("bf16_source"):  # bf16 only probed (emulated here, nothing ran in it): no bf16 reference
            out[f"{phase}_pct_bf16"] = None
        # against the rate of the dtype this phase's matmuls actually run in (fp32 where bf16 is emulated)
        own = result.get(f"{phase}_matmuls", "bf16")
        out[f"{phase}_matmuls"] = own
        out[f"{phase}_pct_own"] = out[f"{phase}_pct_{own}"]
    return out


ROWS = [  # (key, label, format)
    ("step_s", "seconds per step (median)", "{:.2f}"),
    ("sample_s", "  sampling s", "{:.2f}"),
    ("score_s", "  scoring s", "{:.3f}"),
    ("learn_s", "  learning s", "{:.2f}"),
    ("other_s", "  other s (ours: weight sync; TRL: batch prep)", "{:.2f}"),
    ("generated_tokens", "generated tokens per step", "{:.0f}"),
    ("prompt_tokens_per_sample", "prompt tokens per sample", "{:.1f}"),
    ("sampler_tok_s", "sampler tokens/s (generated)", "{:.1f}"),
    ("learner_tok_s", "learner tokens/s (prompt+completion)", "{:.1f}"),
    ("learner_padding_pct", "learner padding, % of token slots", "{:.1f}"),
    ("learner_computed_tokens", "learner positions computed per step (a shared prompt once)", "{:.0f}"),
    ("learner_matmuls_kept_pct", "learner layer slots whose matmuls were kept, not recomputed, %", "{:.0f}"),
    ("sampler_gflop_s", "sampler GFLOP/s", "{:.1f}"),
    ("sampler_matmuls", "sampler matmul dtype", "{}"),
    ("sampler_pct_own", "sampler % of matmul in its dtype", "{:.1f}"),
    ("sampler_pct_bf16", "sampler % of bf16 matmul", "{:.1f}"),
    ("sampler_pct_fp32", "sampler % of fp32 matmul", "{:.1f}"),
    ("learner_gflop_s", "learner GFLOP/s", "{:.1f}"),
    ("learner_matmuls", "learner matmul dtype", "{}"),
    ("learner_pct_own", "learner % of matmul in its dtype", "{:.1f}"),
    ("learner_pct_bf16", "learner % of bf16 matmul", "{:.1f}"),
    ("learner_pct_fp32", "learner % of fp32 matmul", "{:.1f}"),
    ("peak_rss_gib", "peak RSS GiB", "{:.2f}"),
    ("peak_gpu_gib", "peak GPU memory GiB (torch allocator)", "{:.2f}"),
]


def markdown(report: dict) -> str:
    mm = report["matmul"]
    lines = [
        f"# fgrpo vs TRL GRPOTrainer ({report['date']})",
        "",
        f"Machine: {report['machine']}. Versions: {report['versions']}.",
        f"Model: {report['model']}; ours with hardware={report.get('hardware', 'cpu')}"
        + (f" sampler={report['sampler']}" if report.get("sampler") else "")
        + "".join(f" {o}" for o in report.get("overrides", []))
        + f"; lr {report['lr']}; {report['steps']} steps per run, the first dropped"
        + (f"; both train LoRA adapters of rank {report['lora']}, alpha {2 * report['lora']}" if report.get("lora") else "")
        + ".",
        f"Precision: {precision_line(mm)}.",
        f"Matmul {mm['size']}^3 on " + (f"{mm['threads']} threads" if mm.get("device", "cpu") == "cpu" else mm["device"])
        + f": fp32 {mm['fp32_flops'] / 1e9:.1f} GFLOP/s, "
        f"bf16 {mm['bf16_flops'] / 1e9:.1f} GFLOP/s"
        + (f" from the {mm['bf16_source']}" if mm.get("bf16_source") else "")
        + f" (best of {mm.get('reps', 6)}"
        + (", before and after the runs: " + " and ".join(f"{r['fp32_flops'] / 1e9:.1f} / {r['bf16_flops'] / 1e9:.1f}"
                                                           for r in mm["readings"]) if "readings" in mm else "")
        + "). Each phase is also held to the matmul rate of the dtype its matmuls run in.",
        "FLOPs: learner " + ("4 x (LoRA: the frozen weights get no gradient)" if report.get("lora") else "6 x")
        + " (body params x positions computed + head params x completion tokens), positions "
        "computed = prompt+completion tokens, less a shared prompt's repeats (ours); "
        "sampler 2 x (body params x (prompt tokens x G + generated) + head params x (generated + P x G)); "
        "attention scores not counted.",
        "",
    ]
    for name, wl in report["workloads"].items():
        lines.append(f"## Workload {name} (prompts x samples x max new tokens)")
        lines.append("")
        for system in [s for s in SYSTEMS if s in wl]:
            if "error" in wl[system]:
                lines.append(f"- {system}: FAILED: {wl[system]['error']}")
            else:
                lines.append(f"- {system}: sampler {wl[system]['sampler']}; learner {wl[system]['learner']}")
        lines.append("")
        systems = [s for s in SYSTEMS if "summary" in wl.get(s, {})]
        if not systems:
            continue
        header = ["metric", *systems] + (["TRL / ours"] if len(systems) == 2 else [])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for key, label, fmt in ROWS:
            if all(wl[s]["summary"].get(key) is None for s in systems):
                continue  # e.g. GPU memory on a CPU run
            cells = [fmt.format(wl[s]["summary"][key]) if wl[s]["summary"].get(key) is not None else "-" for s in systems]
            if len(systems) == 2:
                ours, trl = wl["ours"]["summary"].get(key), wl["trl"]["summary"].get(key)
                numbers = isinstance(ours, (int, float)) and isinstance(trl, (int, float))
                cells.append(f"{trl / ours:.2f}" if numbers and ours else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def precision_line(matmul: dict) -> str:
    """What ours' ``auto`` dtypes became here, and the probe behind it (from the matmul child)."""
    precision = matmul.get("precision")
    if not precision:
        return "-"
    return (f"ours' learner matmuls in {precision['autocast_dtype'] or 'float32'}, sampler in "
            f"{precision['sampler_dtype']} ({precision['reason']})")
