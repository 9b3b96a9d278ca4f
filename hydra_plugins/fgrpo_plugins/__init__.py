"""fgrpo's Hydra plugins (Hydra finds plugins only under the ``hydra_plugins`` namespace).

- :class:`ValidatingSweeper`: Hydra's basic sweeper that also range-checks every job's composed config
  (``fgrpo.config.validate``) before the first job is launched, so ``focal.gamma=-1,0`` fails at once;
  and that lets every job run when one fails, then lists each failed job with its log path (Hydra's own
  sweeper stops at the first failed batch and prints a traceback).
- :class:`SlurmLauncher`: hydra-submitit-launcher's Slurm launcher that checks for ``sbatch`` before
  submitting, waits for every array task, and reports each failed one with its log paths instead of
  stopping at the first. A job whose training fails exits non-zero, so Slurm (``sacct``) records it FAILED.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, List, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import OmegaConf

from fgrpo.validation import validate, validate_layout
from fgrpo.infra.errors import BAD_INPUT, ConfigError  # BAD_INPUT: errors whose message says everything

log = logging.getLogger("fgrpo")


class SweepJobFailed(RuntimeError):
    """One sweep job failed; the message names the job and its log paths."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def describe_failure(result: JobReturn, job_num: int) -> str:
    """A failed job in a few lines: its number, overrides, error and where its log is."""
    error = result._return_value
    if isinstance(error, SweepJobFailed):
        return str(error)
    overrides = " ".join(result.overrides or [])
    reason = _first_line(error) if isinstance(error, BaseException) else repr(error)
    lines = [f"sweep job #{job_num} [{overrides}] failed: {reason}"]
    hydra_cfg = result.hydra_cfg.hydra if result.hydra_cfg is not None else None
    if hydra_cfg is not None:
        run_dir = Path(str(hydra_cfg.runtime.output_dir))
        lines.append(f"    log: {run_dir / (str(hydra_cfg.job.name) + '.log')}")
        lines.append(f"    run dir: {run_dir}")
    if isinstance(error, BaseException) and not isinstance(error, BAD_INPUT):
        trace = "".join(traceback.format_exception(error)).rstrip()
        lines.append("    " + trace.replace("\n", "\n    "))
    return "\n".join(lines)


class ValidatingSweeper(BasicSweeper):
    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        super().validate_batch_is_legal(batch)  # each job composes
        loader = self.hydra_context.config_loader
        problems = []
        for overrides in batch:
            config = loader.load_sweep_config(master_config=self.config, sweep_overrides=list(overrides))
            try:
                validate(config)
                # a job of several tasks (hydra/launcher=slurm, hardware.slurm_*): its processes, checked before queueing
                launcher = config.hydra.get("launcher") or {}
                validate_layout(config, int(launcher.get("nodes") or 1) * int(launcher.get("tasks_per_node") or 1))
            except ConfigError as error:
                problems.append(f"job [{' '.join(overrides)}]: {str(error).replace('invalid config:', '').strip()}")
        if problems:
            message = (f"{len(problems)} of {len(batch)} sweep jobs have invalid configs; nothing was launched:\n  "
                       + "\n  ".join(problems))
            # bad input: the message alone, no traceback (Hydra prints one for sweeper exceptions)
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)

    def sweep(self, arguments: List[str]) -> Any:
        """BasicSweeper.sweep, except that a failed job does not stop the sweep: every batch runs, then
        each failed job is listed with its log path and the command exits with status 1."""
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params_conf), self.max_batch_size)
        returns: List[Sequence[JobReturn]] = []

        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        failures: list[str] = []
        total = 0
        initial_job_idx = 0
        while not self.is_done():
            batch = self.get_job_batch()
            tic = time.perf_counter()
            self.validate_batch_is_legal(batch)
            log.debug("validated %d jobs in %.2f s", len(batch), time.perf_counter() - tic)
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for index, result in enumerate(results):
                if result.status != JobStatus.COMPLETED:
                    failures.append(describe_failure(result, initial_job_idx + index))
            total += len(batch)
            initial_job_idx += len(batch)
            returns.append(results)

        if failures:
            print(
                f"error: {len(failures)} of {total} sweep jobs failed (the other {total - len(failures)} completed; "
                f"`python -m fgrpo.report {sweep_dir}` tabulates them):\n  " + "\n  ".join(failures),
                file=sys.stderr,
            )
            sys.exit(1)
        return returns


def _submitit_error_line(error: BaseException) -> str:
    """The exception line of a task's error (submitit's FailedJobError wraps the task's whole traceback)."""
    text = str(error)
    if "----------------------" in text:  # FailedJobError: '... trace:\n----\n<traceback>\n----\n...'
        trace = text.split("----------------------")[1].strip().splitlines()
        if trace:
            return trace[-1].strip()
    return _first_line(error)


SUBMISSION_FAILED = "Batch job submission failed:"  # sbatch's line when it refuses a job; others may come before it


def _partition_limit(partition: str | None) -> int | None:
    """The most nodes one job may have in ``partition`` (the default one if None): its nodes, or its MaxNodes if
    lower (scontrol show partition); None where Slurm cannot say."""
    try:
        out = subprocess.run(["scontrol", "show", "partition", "-o", *([partition] if partition else [])],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if partition is None and fields.get("Default") != "YES":
            continue
        limits = [int(fields[key]) for key in ("TotalNodes", "MaxNodes") if fields.get(key, "").isdigit()]
        return min(limits) if limits else None
    return None


def sbatch_refusal(stderr: str, params: dict) -> str | None:
    """One line for sbatch's refusal of a job (submitit raises it with sbatch's stderr), naming the key to change;
    None where ``stderr`` is no refusal (sbatch failed otherwise: no controller, killed)."""
    lines = [line.split("error:", 1)[-1].strip() for line in stderr.splitlines() if "error:" in line]
    reason = next((line.split(SUBMISSION_FAILED, 1)[1].strip() for line in lines if SUBMISSION_FAILED in line), None)
    if reason is None:
        return None
    said = "; ".join(line for line in lines if SUBMISSION_FAILED not in line)  # e.g. which request cannot be met
    reason = f"{said}: {reason}" if said else reason
    partition = params.get("partition")
    where = f"partition {partition}" if partition else "the default partition"
    if "Node count specification invalid" in stderr:
        limit = _partition_limit(partition)
        has = f"takes at most {limit} node(s) a job" if limit else "has fewer nodes"
        return (f"sbatch refused the job ({reason}): hardware.slurm_nodes={params.get('nodes')} but {where} {has}; "
                f"set hardware.slurm_nodes to at most {limit or 'its node count'} or pick another partition "
                f"(hydra.launcher.partition=...).")
    too_big = ("Requested node configuration is not available", "More processors requested than permitted",
               "Memory specification can not be satisfied", "Memory required by task is not available",
               "CPU count per node can not be satisfied")
    if any(phrase in stderr for phrase in too_big):
        return (f"sbatch refused the job ({reason}): no node in {where} has what one node of this job asks for "
                f"(hardware.slurm_tasks_per_node={params.get('tasks_per_node')} x slurm_cpus_per_task="
                f"{params.get('cpus_per_task')} CPUs, slurm_mem_gb={params.get('mem_gb')}, slurm_gpus_per_node="
                f"{params.get('gpus_per_node') or 0}); lower them or pick another partition (hydra.launcher.partition=...).")
    return f"sbatch refused the job: {reason} (the job's request comes from hardware.slurm_* and hydra.launcher.*)."


class SlurmLauncher(SubmititSlurmLauncher):
    def __init__(self, **params: Any) -> None:
        # hardware=cpu asks for 0 GPUs: send no GPU request at all (a node without GRES rejects one)
        if not params.get("gpus_per_node"):
            params["gpus_per_node"] = None
        if params.get("tasks_per_node", 1) * params.get("nodes", 1) > 1:
            # several tasks per job (one per GPU): a task that fails ends the others at once, instead of leaving
            # them waiting in a collective until the process group times out
            params["srun_args"] = [*(params.get("srun_args") or []), "--kill-on-bad-exit=1"]
        super().__init__(**params)

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """Runs one job inside its Slurm task. A failed job raises, so the task exits non-zero (sacct: FAILED)
        and its traceback lands in the task's Slurm stderr log."""
        result = super().__call__(*args, **kwargs)
        if result.status == JobStatus.FAILED and isinstance(result._return_value, BaseException):
            raise result._return_value
        return result

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if shutil.which("sbatch") is None:
            # bad input: the message alone, no traceback, before anything is submitted
            print(
                "error: hydra/launcher=slurm needs Slurm's `sbatch` on PATH, and there is none on this machine: run "
                "the sweep on a cluster's login node, start a local test cluster (scripts/local-slurm start), or "
                "drop hydra/launcher=slurm to run the jobs here one after another. Nothing was submitted.",
                file=sys.stderr,
            )
            sys.exit(2)
        import submitit

        # let the parent submit (its map_array call), but collect the jobs instead of failing on the first
        submitted: list = []
        original_map_array = submitit.AutoExecutor.map_array

        def capture(executor, fn, *iterables):
            jobs = original_map_array(executor, fn, *iterables)
            submitted.extend(jobs)
            return []  # the parent then collects nothing

        submitit.AutoExecutor.map_array = capture
        printed = io.StringIO()  # submitit prints sbatch's stderr when it refuses: said once, in our line, instead
        refusal = None
        try:
            with contextlib.redirect_stderr(printed):
                super().launch(job_overrides, initial_job_idx)
        except submitit.core.utils.FailedJobError as error:
            refusal = sbatch_refusal(str(error), self.params)
            if refusal is None:  # not a refusal of the request (no controller, sbatch killed): as it came
                raise
        finally:
            submitit.AutoExecutor.map_array = original_map_array
            if refusal is None:
                sys.stderr.write(printed.getvalue())
        if refusal is not None:  # sbatch refused the job: bad input, nothing queued
            print(f"error: {refusal} Nothing was submitted.", file=sys.stderr)
            sys.exit(2)

        array_id = str(submitted[0].job_id).split("_")[0] if submitted else "-"
        log.info("waiting for %d Slurm array tasks (job %s)", len(submitted), array_id)
        returns: list[JobReturn] = []
        failures = 0
        for index, (job, overrides) in enumerate(zip(submitted, job_overrides)):
            try:
                result = job.results()[0]
            except Exception as error:  # the job failed, the task crashed, was cancelled, or timed out
                message = (
                    f"sweep job #{initial_job_idx + index} [{' '.join(overrides)}] (Slurm job {job.job_id}) failed: "
                    f"{_submitit_error_line(error)}\n"
                    f"    log: {job.paths.stderr}\n    stdout: {job.paths.stdout}"
                )
                log.error(message)
                failures += 1
                result = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=SweepJobFailed(message))
            returns.append(result)
        if failures:
            log.error("%d of %d sweep jobs failed; the others completed", failures, len(submitted))
        return returns
