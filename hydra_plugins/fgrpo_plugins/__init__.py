"""fgrpo's Hydra plugins (Hydra finds plugins only under the ``hydra_plugins`` namespace).

- :class:`ValidatingSweeper`: Hydra's basic sweeper that also range-checks every job's composed config
  (``fgrpo.config.validate``) before the first job is launched, so ``focal.gamma=-1,0`` fails at once.
- :class:`SlurmLauncher`: hydra-submitit-launcher's Slurm launcher that checks for ``sbatch`` before
  submitting, waits for every array task, and reports each failed one with its log paths instead of
  stopping at the first.
"""

from __future__ import annotations

import logging
import shutil
import sys
from typing import Any, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher

log = logging.getLogger("fgrpo")


class ValidatingSweeper(BasicSweeper):
    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        super().validate_batch_is_legal(batch)  # each job composes
        from fgrpo.config import ConfigError, validate

        loader = self.hydra_context.config_loader
        problems = []
        for overrides in batch:
            config = loader.load_sweep_config(master_config=self.config, sweep_overrides=list(overrides))
            try:
                validate(config)
            except ConfigError as error:
                problems.append(f"job [{' '.join(overrides)}]: {str(error).replace('invalid config:', '').strip()}")
        if problems:
            message = (f"{len(problems)} of {len(batch)} sweep jobs have invalid configs; nothing was launched:\n  "
                       + "\n  ".join(problems))
            # bad input: the message alone, no traceback (Hydra prints one for sweeper exceptions)
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)


class SweepJobFailed(RuntimeError):
    pass


class SlurmLauncher(SubmititSlurmLauncher):
    def __init__(self, **params: Any) -> None:
        # hardware=cpu asks for 0 GPUs: send no GPU request at all (a node without GRES rejects one)
        if not params.get("gpus_per_node"):
            params["gpus_per_node"] = None
        super().__init__(**params)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if shutil.which("sbatch") is None:
            raise SweepJobFailed(
                "hydra/launcher=slurm needs Slurm's `sbatch` on PATH, and there is none on this machine: run the "
                "sweep on a cluster's login node, start a local test cluster (scripts/local-slurm start), or "
                "drop hydra/launcher=slurm to run the jobs here one after another. Nothing was submitted."
            )
        import submitit

        # let the parent submit (its map_array call), but collect the jobs instead of failing on the first
        submitted: list = []
        original_map_array = submitit.AutoExecutor.map_array

        def capture(executor, fn, *iterables):
            jobs = original_map_array(executor, fn, *iterables)
            submitted.extend(jobs)
            return []  # the parent then collects nothing

        submitit.AutoExecutor.map_array = capture
        try:
            super().launch(job_overrides, initial_job_idx)
        finally:
            submitit.AutoExecutor.map_array = original_map_array

        log.info("waiting for %d Slurm array tasks (job %s)", len(submitted), submitted[0].job_id if submitted else "-")
        returns: list[JobReturn] = []
        failures: list[str] = []
        for index, (job, overrides) in enumerate(zip(submitted, job_overrides)):
            try:
                returns.append(job.results()[0])
            except Exception as error:  # the task crashed, was cancelled, or timed out
                message = (
                    f"sweep job #{initial_job_idx + index} [{' '.join(overrides)}] (Slurm job {job.job_id}) failed: "
                    f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}\n"
                    f"    log: {job.paths.stderr}\n    stdout: {job.paths.stdout}"
                )
                log.error(message)
                failures.append(message)
                failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=SweepJobFailed(message))
                returns.append(failed)
        if failures:
            log.error("%d of %d sweep jobs failed; the others completed", len(failures), len(submitted))
        return returns
