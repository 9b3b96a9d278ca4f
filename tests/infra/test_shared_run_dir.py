"""Every rank must see the run directory rank 0 writes (fgrpo.infra.distributed.check_shared_run_dir). Two "nodes" of
one process each, torchrun over the loopback address, the second in a mount namespace of its own where a tmpfs hides
the directory, as on a node whose run directory is local: every rank stops with one line naming hydra.run.dir, before
any model loads, and none is left waiting."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ci_strict import skip_unless_ci
from fgrpo.infra.distributed import _free_port as free_port
from test_launch import LAUNCHER_PREFIXES, QUICK, TINY
from test_sweep import LAUNCH_ENV

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def node(rank: int, port: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1",
            "--master-addr=127.0.0.1", f"--master-port={port}", str(REPO / "run.py"), *TINY, f"hydra.run.dir={run_dir}"]


def test_a_rank_that_cannot_see_the_run_directory_stops_every_rank_in_one_line(tmp_path):
    if shutil.which("unshare") is None or os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"]).returncode:
        skip_unless_ci("needs unshare -m as root: a mount namespace in which the second node's run directory is hidden")
    shared = tmp_path / "shared"
    run_dir = shared / "run"
    shared.mkdir()
    port = free_port()
    env = {name: value for name, value in LAUNCH_ENV.items() if not name.startswith(LAUNCHER_PREFIXES)}
    env.update(QUICK)
    hidden = f"mount -t tmpfs tmpfs {shared} && exec " + " ".join(node(1, port, run_dir))
    processes = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
                 for command in (node(0, port, run_dir), ["unshare", "-m", "sh", "-c", hidden])]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for each in processes:
                os.killpg(each.pid, signal.SIGKILL)
            raise AssertionError(f"a node still running after {TIMEOUT_S} s: a rank left waiting")
    assert all(p.returncode != 0 for p in processes)
    said = outputs[0][0] + outputs[0][1]  # rank 0's: Hydra logs to stdout, the error goes to stderr
    assert f"hydra.run.dir={run_dir}: rank 1 (on " in said and "does not see the files rank 0 writes there" in said
    worker = outputs[0][1].split("torch/distributed/elastic")[0]  # torchrun's agent then reports the exit its way
    assert worker.count("does not see the files") == 1 and "Traceback" not in worker
    assert "precision:" not in said  # stopped before the model's settings, let alone its weights
    assert not list(run_dir.glob(".fgrpo-shared-*"))  # the marker removed
