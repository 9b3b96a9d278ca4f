"""Host memory per rank while a sharded learner loads: each of N gloo ranks builds fgrpo's Learner (the policy, and
with ``--kl`` the KL reference) from a model's HF folder, as a run does, and reports its peak resident memory
(the kernel's high-water mark, the model file's mapped pages included), its memory after the load, and the time.

    python bench/rank_load_memory.py                                   # qwen2_5_1_5b_random, 2 ranks, as loaded today
    python bench/rank_load_memory.py --each-rank-whole                 # the load before issue 65: every rank whole
    python bench/rank_load_memory.py --model smollm2_135m --ranks 2 --kl

Today rank 0 reads the weights and the other ranks build the model on the meta device and take their shards from
rank 0 (fgrpo.learner.sharded_load); ``--each-rank-whole`` switches that off, so that one script measures both. No
sampler runs (with sampler=hf the learner's policy is the sampler; a vLLM engine would load its own whole copy).
The random model's folder is built in the fgrpo cache first if it is not there (about 6 GB for Qwen2.5-1.5B's shape).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB = 2**30


def status_gib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: now, VmHWM: the high-water mark) in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def rss_gib() -> float:
    return status_gib("VmRSS")


def peak_gib() -> float:
    """The high-water mark, by the kernel's two counts (a sandboxed kernel may update one of them lazily) and now."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, status_gib("VmHWM"), rss_gib())


class PeakSampler:
    """The peaks of the process's anonymous memory (its own: tensors, buffers) and of its file-backed resident pages
    (a safetensors file mapped and read: page cache, shared by the processes of a node, dropped under pressure),
    sampled every 10 ms: the kernel keeps a high-water mark of their sum only."""

    def __init__(self):
        import threading

        self.anon = self.file = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.anon, self.file = max(self.anon, status_gib("RssAnon")), max(self.file, status_gib("RssFile"))

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def bf16_copy(folder: Path) -> Path:
    """``folder`` with its weights in bf16, made once beside it (tensor by tensor: no model is built)."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = folder.with_name(folder.name + "-bf16")
    if (target / ".complete").is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for item in folder.iterdir():
        if item.suffix == ".safetensors":
            with safe_open(str(item), framework="pt") as weights:
                tensors = {key: weights.get_tensor(key).to(torch.bfloat16) for key in weights.keys()}
            save_file(tensors, str(target / item.name), metadata={"format": "pt"})
            del tensors
        elif item.is_file():
            shutil.copy2(item, target / item.name)
    (target / ".complete").write_text("ok\n")
    return target


def compose(model: str, kl: bool):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fgrpo.config import register_configs

    register_configs()
    overrides = [f"model={model}", "sampler=hf", "hardware.compile_learner=false", "hardware.autocast_dtype=null",
                 f"algo.kl_coef={0.1 if kl else 0.0}"]
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        return hydra_compose("config", overrides=overrides)


def rank_main(args) -> None:
    """One rank: join the group, build the learner, report its memory (rank 0 prints every rank's as JSON)."""
    import fgrpo.learner.learner as learner_module
    from fgrpo.infra import distributed
    from fgrpo.prepare import learner_settings, loss_settings

    ranks = distributed.init_from_env()
    cfg = compose(args.model, args.kl)
    folder = Path(args.folder)  # built by the parent
    if args.each_rank_whole:  # the load before issue 65: every rank reads the whole model, FSDP2 shards it
        learner_module.builds_on_meta = lambda sharded: False
        learner_module.shard_from_rank0 = lambda model, shard, **where: shard()
    before = rss_gib()
    distributed.agree(lambda: None)  # start together
    start = time.perf_counter()
    with PeakSampler() as peaks:
        learner = learner_module.Learner(folder, learner_settings(cfg), loss_settings(cfg.algo), pad_id=0)
    seconds = time.perf_counter() - start
    mine = {"rank": ranks.rank, "rss_before_gib": before, "rss_after_gib": rss_gib(), "peak_gib": peak_gib(),
            "peak_anon_gib": peaks.anon, "peak_file_gib": peaks.file, "load_s": seconds,
            "params": sum(p.numel() for p in learner.policy.parameters())}
    everyone = distributed.gather_objects(mine)
    if ranks.main:
        print(json.dumps(everyone))
    distributed.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2_5_1_5b_random", help="a conf/model/ option")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--kl", action="store_true", help="a KL term: a second, frozen model loads the same way")
    parser.add_argument("--each-rank-whole", action="store_true", help="the load before: every rank reads the whole model")
    parser.add_argument("--saved-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the dtype of the weights in the folder (bfloat16: as hub models are released; a copy of "
                             "the folder in bf16 is made once, beside it, and loaded into fp32 weights)")
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        return rank_main(args)

    from fgrpo.infra.precision import cpu_kind, cpu_name
    from fgrpo.learner.model import resolve_model_folder

    folder = resolve_model_folder(compose(args.model, args.kl).model)  # once, before the ranks start
    if args.saved_dtype == "bfloat16":
        folder = bf16_copy(folder)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               __file__, "--rank-child", "--model", args.model, "--folder", str(folder)] + (["--kl"] if args.kl else []) \
        + (["--each-rank-whole"] if args.each_rank_whole else [])
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"the ranks failed:\n{done.stderr[-3000:]}")
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    way = "every rank whole (before)" if args.each_rank_whole else "rank 0 reads, the others on meta (today)"
    print(f"{args.model} (saved in {args.saved_dtype}), {rows[0]['params'] / 1e6:.0f} M parameters, {args.ranks} gloo ranks{', with a KL reference' if args.kl else ''}: "
          f"{way}; {cpu_name()} ({cpu_kind()}), {os.cpu_count()} cores")
    print("| rank | RSS before (GiB) | peak RSS while loading (GiB) | of it, peak anonymous | peak file-backed | "
          "RSS after (GiB) | load (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['rank']} | {row['rss_before_gib']:.2f} | {row['peak_gib']:.2f} | {row['peak_anon_gib']:.2f} | "
              f"{row['peak_file_gib']:.2f} | {row['rss_after_gib']:.2f} | {row['load_s']:.1f} |")
    for key, what in (("peak_gib", "peak RSS"), ("peak_anon_gib", "peak anonymous memory")):
        others = max(row[key] for row in rows[1:]) if len(rows) > 1 else float("nan")
        print(f"largest non-zero rank's {what} / rank 0's: {others / rows[0][key]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "saved_dtype": args.saved_dtype, "ranks": args.ranks, "kl": args.kl,
                                         "each_rank_whole": args.each_rank_whole, "cpu": cpu_kind(), "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
