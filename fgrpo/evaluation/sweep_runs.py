"""The runs of a sweep directory, as ``python -m fgrpo.report`` reads them: each run's saved config and metrics
(``.hydra/config.yaml``, ``.hydra/hydra.yaml``, ``metrics.jsonl``), the jobs of the sweep's ``multirun.yaml`` that left
no run directory (with submitit's Slurm log where there is one), the check that the runs differ only in algo, gamma
and seed, and the completed runs grouped by table cell (algo, advantage method, gamma)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from fgrpo.algorithm.advantage_methods import method_label, methods
from fgrpo.algorithm.advantage_registry import REFERENCE
from fgrpo.infra.run_files import read_metrics, upgraded_config

# keys that identify a table cell (with the advantage.* keys) or may differ between runs of one sweep
CELL_KEYS = ("algo.name", "focal.gamma")
# what `auto` settles per job from the machine it runs on (fgrpo.infra.precision), written into its saved config
SETTLED_KEYS = {"hardware.autocast_dtype", "hardware.sampler_dtype", "hardware.keep_matmul_outputs_gib"}
# (eval.before and eval.rare_set measure more or less of a run, not how it trains: a sweep run in parts may differ)
FREE_KEYS = ("seed", "run_name", "logger.group", "logger.tags", "logger.mode", "trainer.save_final",
             "trainer.profile_step", "eval.before", "eval.rare_set")


class ReportError(ValueError):
    """The sweep directory cannot be reported on; the message says why and what to pass."""


@dataclass
class Run:
    path: Path
    config: dict
    evals: list[dict] = field(default_factory=list)  # rows of metrics.jsonl with eval/pass@1
    status: str = "completed"  # completed | failed
    log_path: Path | None = None
    job_num: int | None = None  # Hydra's hydra.job.num (the #i of the sweep's job list)
    job_id: str | None = None  # Hydra's hydra.job.id (the Slurm job id, e.g. 12_3, under submitit)
    steps: list[dict] = field(default_factory=list)  # rows of metrics.jsonl with train/* (one per training step)

    @property
    def algo(self) -> str:
        return self.config["algo.name"]

    @property
    def gamma(self) -> float:
        return float(self.config["focal.gamma"])

    @property
    def method(self) -> str:
        """The advantage method with its parameter (``focal``, ``maxrl``, ``passk k=4``, ...); runs saved before the
        ``advantage`` option had focal."""
        name = self.config.get("advantage.name", REFERENCE)
        declared = methods().get(name)
        if declared is None:  # a user's method, by import path: every parameter it was given
            params = {key.split(".", 1)[1]: value for key, value in self.config.items()
                      if key.startswith("advantage.") and key != "advantage.name" and value is not None}
        else:
            params = {key: param.default if self.config.get(declared.key(key)) is None
                      else self.config[declared.key(key)] for key, param in declared.params.items()}
        return method_label(name, params, with_gamma=False)

    @property
    def final(self) -> dict:
        return self.evals[-1] if self.evals else {}

    @property
    def before(self) -> dict:
        """The evaluation before training (step 0); {} for a run with eval.before=false."""
        return self.evals[0] if self.evals and self.evals[0].get("step") == 0 else {}


def pass_at_ks(row: dict) -> list[int]:
    """The k of each ``eval/pass@k`` in a metrics row (the average over eval sets), ascending."""
    return sorted(int(key.split("@")[1]) for key in row if key.startswith("eval/pass@") and key.split("@")[1].isdigit())


def _flatten(tree, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _slurm_log(sweep_dir: Path, job_id: str | None) -> Path | None:
    """submitit's stderr log of one Slurm task (.submitit/<job>_<task>/<job>_<task>_0_log.err), if there."""
    if not job_id:
        return None
    logs = sorted((sweep_dir / ".submitit" / job_id).glob(f"{job_id}_*_log.err"))
    return logs[0] if logs else None


def _job_log(run_dir: Path, sweep_dir: Path, job_id: str | None = None) -> Path | None:
    """The most useful log of a run: submitit's stderr of its Slurm task (it holds the traceback), else
    Hydra's job log in the run directory."""
    slurm = _slurm_log(sweep_dir, job_id)
    if slurm is not None:
        return slurm
    logs = sorted(run_dir.glob("*.log"))
    return logs[0] if logs else None


def _load_yaml(path: Path):
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def sweep_jobs(sweep_dir: Path) -> dict[int, list[str]] | None:
    """The sweep's job list {job number: overrides}, expanded from its multirun.yaml as Hydra's basic
    sweeper does; None when there is no multirun.yaml or it cannot be expanded."""
    multirun = _load_yaml(Path(sweep_dir) / "multirun.yaml")
    hydra = multirun.get("hydra") if isinstance(multirun, dict) else None
    if not isinstance(hydra, dict):
        return None
    arguments = [f"{key}={value}" for key, value in ((hydra.get("sweeper") or {}).get("params") or {}).items()]
    arguments += list((hydra.get("overrides") or {}).get("task") or [])
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(arguments), None)
    except Exception:  # e.g. a glob over config groups, which needs the config tree: skip this check
        return None
    return {num: list(overrides) for num, overrides in enumerate(job for batch in batches for job in batch)}


def _slurm_tasks(sweep_dir: Path) -> list[str]:
    """submitit's Slurm task folders (<job>_<task>) in submission order."""
    names = [p.name for p in (Path(sweep_dir) / ".submitit").glob("*_*") if p.is_dir()]
    tasks = [n for n in names if all(part.isdigit() for part in n.split("_"))]
    return sorted(tasks, key=lambda n: tuple(int(part) for part in n.split("_")))


@dataclass
class MissingJob:
    """A job of the sweep's list that left no run directory (it failed before Hydra made one, or never ran)."""

    job_num: int
    overrides: list[str]
    job_id: str | None = None
    log_path: Path | None = None


def find_missing_jobs(sweep_dir: Path, runs: list[Run]) -> list[MissingJob]:
    jobs = sweep_jobs(sweep_dir)
    if not jobs:
        return []
    seen = {run.job_num for run in runs}
    missing = [MissingJob(num, overrides) for num, overrides in jobs.items() if num not in seen]
    tasks = _slurm_tasks(sweep_dir)
    # a sweep submitted once has one task per job, in job order; use that only if the runs agree with it
    if len(tasks) == len(jobs) and all(run.job_id is None or tasks[run.job_num] == run.job_id
                                       for run in runs if run.job_num is not None and run.job_num < len(tasks)):
        for job in missing:
            job.job_id = tasks[job.job_num]
            job.log_path = _slurm_log(sweep_dir, job.job_id)
    return missing


def find_runs(sweep_dir: Path) -> list[Run]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ReportError(f"{sweep_dir} is not a directory: pass a sweep directory such as outputs/multirun/<date>/<time>")
    runs = []
    for config_file in sorted(sweep_dir.rglob(".hydra/config.yaml")):
        run_dir = config_file.parent.parent
        config = _flatten(upgraded_config(_load_yaml(config_file)))
        if "algo.name" not in config or "focal.gamma" not in config:
            continue
        job = (_load_yaml(config_file.parent / "hydra.yaml").get("hydra") or {}).get("job") or {}
        job_num = job.get("num") if isinstance(job.get("num"), int) else None
        job_id = str(job["id"]) if job.get("id") not in (None, "???") else None
        metrics_file = run_dir / "metrics.jsonl"
        try:
            rows = read_metrics(metrics_file) if metrics_file.exists() else []
        except ValueError:  # a corrupt metrics.jsonl: count the run as failed
            rows = []
        evals = [row for row in rows if "eval/pass@1" in row]
        steps = [row for row in rows if "train/frac_all_correct" in row]
        finished = bool(evals) and evals[-1].get("step") == config.get("trainer.steps")
        runs.append(Run(run_dir, config, evals, "completed" if finished else "failed",
                        _job_log(run_dir, sweep_dir, job_id), job_num, job_id, steps))
    if not runs:
        raise ReportError(
            f"no runs found under {sweep_dir}: a run directory holds .hydra/config.yaml and metrics.jsonl "
            "(pass the sweep directory that `python run.py -m ...` printed)"
        )
    return runs


def check_same_config(runs: list[Run]) -> None:
    """Runs of one table must differ only in algo, gamma and seed (and what the algo option sets)."""
    completed = [r for r in runs if r.status == "completed"]
    differing = {}
    keys = set().union(*(r.config for r in completed)) if completed else set()
    for key in sorted(keys):
        if key in FREE_KEYS or key.startswith(("algo.", "focal.", "advantage.")):
            continue
        values = {repr(r.config.get(key)) for r in completed}
        if len(values) > 1:
            differing[key] = sorted(values)
    if differing:
        lines = [f"  {key}: {', '.join(values)}" for key, values in differing.items()]
        fix = "report on each configuration's sweep directory separately"
        if differing.keys() & SETTLED_KEYS:
            fix = ("`auto` precision settled differently from job to job (jobs on different kinds of CPU: a bf16 "
                   "matmul is native on some and emulated on others); run the sweep again with the dtypes pinned, "
                   "e.g. hardware.autocast_dtype=float32 hardware.sampler_dtype=float32, or " + fix)
        raise ReportError(
            "the runs under this directory mix different configurations, so one algo x gamma table would "
            "compare unlike things:\n" + "\n".join(lines) + "\n" + fix
        )


def largest_final_k(runs: list[Run]) -> int:
    """The largest k of an ``eval/pass@k`` in the runs' final evaluation rows."""
    ks = [k for r in runs for k in pass_at_ks(r.final)]
    return max(ks)



Cell = tuple[str, str, float]  # (algo, advantage method, gamma)


def reference_cell(cell: Cell) -> Cell:
    """What a cell is compared with: the plain algorithm (focal at gamma 0) of the same algo."""
    return (cell[0], REFERENCE, 0.0)


def _seed_key(run: Run) -> tuple:
    seed = run.config.get("seed")
    return (0, seed, "") if isinstance(seed, int) else (1, 0, str(seed))


def completed_cells(runs: list[Run]) -> dict[Cell, list[Run]]:
    """The completed runs by table cell (algo, gamma), each cell's runs in seed order."""
    cells: dict[Cell, list[Run]] = defaultdict(list)
    for run in sorted((r for r in runs if r.status == "completed"), key=_seed_key):
        cells[(run.algo, run.method, run.gamma)].append(run)
    return cells
