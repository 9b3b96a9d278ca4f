"""What a checkpoint costs: its size on disk and the seconds to save and to load it, for a model's learner (fp32
weights and AdamW's two moments, as the loop holds them after a step), in one process.

    python bench/checkpoint_io.py                       # the bundled SmolLM2-135M (the default run's model)
    python bench/checkpoint_io.py --model tiny_random --repeats 5
    python bench/checkpoint_io.py --dir /scratch/ckpt   # the file system a run directory would be on

Prints one line per repeat and the medians; nothing leaves --dir (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_kind() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "no native bf16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model/ option (default: smollm2_135m)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()

    import torch
    from hydra import compose, initialize_config_dir

    from fgrpo.infra import checkpoint
    from fgrpo.config import register_configs
    from fgrpo.learner.model import load_policy, resolve_model_folder

    register_configs()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={args.model}"])
    policy = load_policy(resolve_model_folder(cfg.model), dtype="float32", device="cpu")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)
    for parameter in policy.parameters():  # AdamW's moments exist after the first step
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in policy.parameters())
    print(f"{args.model}: {params / 1e6:.1f} M parameters; {platform.processor() or platform.machine()}, {cpu_kind()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    saves, loads = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for repeat in range(args.repeats):
            run_dir = Path(scratch) / f"run{repeat}"
            state = checkpoint.TrainerState(step=1, stream={"epoch": 0, "cursor": 0}, scheduler={})
            start = time.perf_counter()
            path = checkpoint.save_checkpoint(run_dir, policy, optimizer, state, keep=1)
            saves.append(time.perf_counter() - start)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            start = time.perf_counter()
            checkpoint.resume(run_dir, policy, optimizer)
            loads.append(time.perf_counter() - start)
            print(f"  repeat {repeat}: {size / 2**30:.2f} GiB, save {saves[-1]:.2f} s, load {loads[-1]:.2f} s")
    print(f"median: save {statistics.median(saves):.2f} s, load {statistics.median(loads):.2f} s "
          f"({size / 2**30:.2f} GiB, {size / 2**30 / statistics.median(saves):.2f} GiB/s written)")


if __name__ == "__main__":
    main()
