"""Process memory (fgrpo.infra.process_memory): freed blocks kept within a step and handed back after it; the matmul
kernel caches bounded as shapes change. In child processes: both are process-wide settings."""

import os




GLIBC_MEMORY_PROBE = """
import torch
from fgrpo.infra.process_memory import keep_freed_memory, release_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

assert keep_freed_memory()
block = torch.ones(256 << 20, dtype=torch.uint8)  # under the 1 GiB mmap threshold: a heap block
before = rss()
del block
kept = rss()
assert release_freed_memory()
print(before - kept, kept - rss())
"""


def test_freed_memory_is_kept_within_a_step_and_released_after_it():
    """keep_freed_memory holds freed blocks (no page faults next time); release_freed_memory hands them back.

    In a child process: both change process-wide malloc settings."""
    import platform
    import subprocess
    import sys

    from fgrpo.infra.process_memory import keep_freed_memory, release_freed_memory

    if not (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"):
        assert keep_freed_memory() is False and release_freed_memory() is False
        return
    out = subprocess.run([sys.executable, "-c", GLIBC_MEMORY_PROBE], capture_output=True, text=True, check=True)
    dropped_on_free, dropped_on_release = (int(x) for x in out.stdout.split())
    assert dropped_on_free < 16 << 20  # freeing alone keeps the block's pages
    assert dropped_on_release > 200 << 20  # the trim returns them


KERNEL_CACHE_PROBE = """
import os, sys, torch
from fgrpo.infra.process_memory import bound_kernel_caches, release_freed_memory

print(bound_kernel_caches(), file=sys.stderr)
torch.set_num_threads(2)
# the learner's matmul dtype here: bf16 (oneDNN's kernels) where it is native; where it is emulated, fp32 (1.4 TFLOP
# of emulated bf16 would take hours)
from fgrpo.infra.precision import bf16_is_fast, probe_matmul_rates
dtype = torch.bfloat16 if bf16_is_fast(probe_matmul_rates()) else torch.float32
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
weight = torch.randn(576, 1536, dtype=dtype)
def matmul_with_grad(rows):
    x = torch.randn(rows, 576, dtype=dtype, requires_grad=True)
    (x @ weight).sum().backward()
for rows in range(1000, 1064):  # the caches full
    matmul_with_grad(rows)
release_freed_memory()
start = rss()
for rows in range(1064, 1364):  # 300 new shapes, as 300 learner steps' row widths would bring
    matmul_with_grad(rows)
release_freed_memory()
print(rss() - start)
"""


def test_matmul_kernel_caches_stay_bounded_as_shapes_change(monkeypatch):
    """Each new matmul shape adds a kernel to oneDNN's and ideep's caches; capped at 64 the memory stays flat.

    In a child process (the caches read the cap once). Without the cap, on the 2-core Xeon here, the
    same probe grew by 558 MiB."""
    import platform
    import subprocess
    import sys

    from fgrpo.infra.process_memory import KERNEL_CACHE_CAPACITY, bound_kernel_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # a user's own setting wins
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # so that the test's own setting is undone after it
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert bound_kernel_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_CAPACITY),
                                     "LRU_CACHE_CAPACITY": "7"}
    if platform.system() != "Linux":
        return
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", KERNEL_CACHE_PROBE], capture_output=True, text=True, check=True, env=env)
    assert "'LRU_CACHE_CAPACITY': '64'" in out.stderr
    assert int(out.stdout) < 64 << 20
