"""Evaluate a model on its own, by the paper's protocol: pass@k for k = 1, 2, 4, ..., n from n samples per problem.

    python -m fgrpo.evaluate eval.model=outputs/2026-11-25/10-00-00       # a run: its final_model, else its latest checkpoint
    python -m fgrpo.evaluate eval.model=outputs/2026-11-25/10-00-00/checkpoints/step_40 eval.n_samples=1024
    python -m fgrpo.evaluate model=qwen2_5_7b dataset=deepscaler hardware=gpu eval.n_samples=1024   # a base model

The Hydra groups are run.py's: ``model`` gives the prompt format (and, without ``eval.model``, the weights),
``dataset`` the evaluation sets, ``hardware``, ``sampler`` and ``logger`` the rest; ``eval.n_samples`` (n, up to
1024 and more) and ``eval.max_problems`` the size. ``eval.model`` names the weights: a run directory, a checkpoint
folder, an HF folder or a hub id. It writes into ``outputs/eval/DATE/TIME`` (or ``hydra.run.dir=...``):
``eval_counts.jsonl`` (the per-problem counts that fgrpo.compare reads), ``pass_at_k.md`` (the table with bootstrap
intervals over problems), ``pass_at_k.png``, ``metrics.jsonl``/``summary.json`` and a W&B run as in training.
The draws use the training run's evaluation seed (``seed`` + :data:`fgrpo.prepare.EVAL_SEED_OFFSET`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")

from omegaconf import DictConfig  # noqa: E402

# only modules that import without torch at the top: the reward pool's worker processes start by re-importing this
# module (multiprocessing's spawn, under `python -m fgrpo.evaluate`), and each would load torch for nothing
from fgrpo.config import register_configs, to_container  # noqa: E402
from fgrpo.evaluation.pass_at_k import default_ks  # noqa: E402
from fgrpo.evaluation.plots import plot_pass_at_k  # noqa: E402
from fgrpo.infra.errors import BAD_INPUT, ConfigError  # noqa: E402
from fgrpo.infra.run_files import COUNTS_FILE, PASS_AT_K_PLOT  # noqa: E402
from fgrpo.validation import validate  # noqa: E402

log = logging.getLogger("fgrpo")


def pass_at_k_markdown(metrics: dict[str, float], dataset_names: list[str], n_samples: int, problems: dict[str, int]) -> str:
    """The markdown table of pass@k with its 95% bootstrap interval (over problems), per set and averaged."""
    rows = ["| set | problems | n | k | pass@k | 95% interval |", "|---|---:|---:|---:|---:|---|"]
    names = [(name, f"eval/{name}/") for name in dataset_names]
    if len(dataset_names) > 1:
        names.append(("average", "eval/"))
    for label, prefix in names:
        count = problems.get(label, sum(problems.values()))
        for k in default_ks(n_samples):
            key = f"{prefix}pass@{k}"
            rows.append(f"| {label} | {count} | {n_samples} | {k} | {metrics[key]:.4f} | "
                        f"[{metrics[key + '_ci_low']:.4f}, {metrics[key + '_ci_high']:.4f}] |")
    return "\n".join(rows) + "\n"


def evaluate_model(cfg: DictConfig, out_dir: Path, *, run_name: str | None = None, overrides: list[str] | None = None,
                   saved_config: Path | None = None) -> dict[str, float]:
    """Evaluate the model ``cfg.eval.model`` names (see the module's docstring); returns the pass@k metrics."""
    from fgrpo.evaluation.held_out import evaluate  # torch: here, not at the top (see the imports)
    from fgrpo.learner.model import load_policy
    from fgrpo.learner.model_source import check_prompt_format, locate_model, model_folder
    from fgrpo.prepare import EVAL_SEED_OFFSET, make_sampler, make_tracker, prepare

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("fgrpo.evaluate runs in one process: start it with python, not torchrun or srun -n >1")
    validate(cfg)
    source = locate_model(cfg.eval.model)  # before anything loads: a wrong path fails at once
    check_prompt_format(source, cfg.model)
    if (out_dir / COUNTS_FILE).exists():
        raise ConfigError(f"{out_dir} already holds an evaluation ({COUNTS_FILE}): pass another hydra.run.dir")

    def folder() -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        return model_folder(source, cfg, out_dir)

    run = prepare(cfg, saved_config=saved_config, training=False, model_folder=folder)
    hw = cfg.hardware
    # the learner's attention kernel: the HF sampler of a training run generates with it
    policy = (load_policy(run.folder, dtype=hw.learner_dtype, device=hw.device, attention=hw.attention).eval()
              if cfg.sampler.name == "hf" else None)
    log.info("evaluating %s (%s%s): %s x %d samples", source.location or f"model={cfg.model.name}", source.kind,
             f", step {source.step}" if source.step is not None else "",
             ", ".join(f"{name} {min(len(p), cfg.eval.max_problems)} problems" for name, p in run.data.eval.items()),
             cfg.eval.n_samples)
    sampler = make_sampler(cfg, run.folder, policy, run.tokenizer)
    try:
        with make_tracker(cfg, out_dir, run_name, overrides, run.precision) as tracker:
            metrics, curve, count_rows = evaluate(
                sampler, run.data.eval, run.prompt_ids, run.scorer, n_samples=cfg.eval.n_samples,
                max_problems=cfg.eval.max_problems, max_new_tokens=cfg.sampler.max_new_tokens,
                temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p, seed=cfg.seed + EVAL_SEED_OFFSET,
                environment=run.environment)
            final = _write_results(cfg, out_dir, source, run, metrics, curve, count_rows, tracker)
    finally:
        run.scorer.close()
        sampler.close()
    return final


def _write_results(cfg: DictConfig, out_dir: Path, source, run, metrics: dict, curve, count_rows: list[dict],
                   tracker) -> dict[str, float]:
    """eval_counts.jsonl, pass_at_k.md, pass_at_k.png, the tracker's rows and summary; returns the final metrics."""
    from fgrpo.evaluation.held_out import append_counts
    append_counts(out_dir, source.step, count_rows)
    problems = {name: min(len(p), cfg.eval.max_problems) for name, p in run.data.eval.items()}
    (out_dir / "pass_at_k.md").write_text(pass_at_k_markdown(metrics, list(run.data.eval), cfg.eval.n_samples, problems))
    label = f"{Path(source.location).name if source.location else cfg.model.name}"
    plot_pass_at_k({label: curve}, out_dir / PASS_AT_K_PLOT, title=f"{label} | {cfg.dataset.name} | n={cfg.eval.n_samples}")
    tracker.log(metrics, step=source.step or 0)
    tracker.log_image("eval/pass_at_k_curve", out_dir / PASS_AT_K_PLOT, step=source.step or 0)
    final = {k: v for k, v in metrics.items() if not k.endswith(("_ci_low", "_ci_high"))}
    tracker.summary({**final, "eval/model": source.location or cfg.model.name, "eval/model_kind": source.kind,
                     "eval/model_step": source.step})
    return final


def _default_run_dir(argv: list[str]) -> None:
    """Evaluations go under outputs/eval/ unless the command names a directory."""
    if not any(arg.startswith("hydra.run.dir=") for arg in argv):
        argv.append("hydra.run.dir=outputs/eval/${now:%Y-%m-%d}/${now:%H-%M-%S}")


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_configs()
    _default_run_dir(sys.argv)

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def app(cfg: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        out_dir = Path(hydra_cfg.runtime.output_dir)
        saved = out_dir / hydra_cfg.output_subdir / "config.yaml" if hydra_cfg.output_subdir else None
        log.info("evaluation directory: %s", out_dir)
        try:
            final = evaluate_model(cfg, out_dir, run_name=f"eval-{hydra_cfg.job.override_dirname or 'default'}",
                                   overrides=list(hydra_cfg.overrides.task), saved_config=saved)
        except BAD_INPUT as error:
            log.error("%s", error)
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        print(f"pass@k of {to_container(cfg)['eval']['model'] or cfg.model.name} written to {out_dir}")
        print((out_dir / "pass_at_k.md").read_text(), end="")
        log.info("final: %s", {k: round(v, 4) for k, v in final.items() if k.count("/") == 1})

    app()


if __name__ == "__main__":
    main()
