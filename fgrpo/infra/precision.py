"""Which floating-point type runs fast here: the learner's autocast dtype and the sampler's dtype.

On CPUs with native bf16 instructions (x86 AVX512-BF16 or AMX, Arm's BF16 extension) a bf16 matmul runs
2-7x faster than an fp32 one, so the learner multiplies in bf16 over fp32 weights and vLLM samples in bf16.
On CPUs without them (AVX2-only x86: many laptops, login nodes, older servers) there is no bf16 kernel
and torch emulates one, about 200x slower than fp32: a bf16 default there never finishes its first
evaluation. So ``hardware.autocast_dtype`` and ``hardware.sampler_dtype`` default to ``auto``, settled
by a short timed probe of both dtypes on a matmul of the learner's kind (:func:`probe_matmul_rates`):
bf16 where it is at least :data:`BF16_MIN_SPEEDUP` times faster than fp32, fp32 elsewhere. A probe
rather than CPU flags, because flags say what an instruction set has, not what torch's kernels do with
it on this build (an emulator, a VM that hides AMX, oneDNN capped by ``ONEDNN_MAX_CPU_ISA``...).

An explicit value wins; an explicit bf16 where it runs far slower than fp32 gets a warning with both rates.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger("fgrpo")

# bf16 is chosen only where its matmuls beat fp32 by this much: autocast also pays for casts, and bf16
# rounds (8-bit mantissa). Measured: AVX512-BF16 2.3-2.8x, AMX 6.6-7.4x, AVX2-only about 0.005x
BF16_MIN_SPEEDUP = 1.5
# an explicit bf16 under this fraction of the fp32 rate gets a warning
BF16_SLOW_FRACTION = 0.5
# [rows, hidden] @ [hidden, intermediate] of SmolLM2-135M's MLP: a matmul the learner and vLLM both run.
# 64 rows keep an emulated bf16 probe to a few seconds (0.1-0.2 GFLOP/s on AVX2-only CPUs)
# what hardware.autocast_dtype and hardware.sampler_dtype accept (None / float32: matmuls in the weights' dtype)
AUTOCAST_CHOICES = ("auto", "float32", "bfloat16", "float16", None)
SAMPLER_CHOICES = ("auto", "float32", "bfloat16", "float16")
PROBE_SHAPE = (64, 576, 1536)
PROBE_BUDGET_S = 0.2  # both dtypes, taking turns: repeat while this lasts, keep the best of each
PROBE_MIN_ROUNDS = 3


@dataclass(frozen=True)
class MatmulRates:
    """Best-of-N FLOP/s of one matmul shape in fp32 and bf16 on ``threads`` threads (the probe uses one)."""

    fp32: float
    bf16: float
    shape: tuple[int, int, int]
    threads: int

    @property
    def bf16_speedup(self) -> float:
        return self.bf16 / self.fp32


@dataclass(frozen=True)
class Precision:
    """What ``auto`` (or the user) settled on, and why: logged at start and kept in the W&B config."""

    autocast_dtype: str | None  # the learner's matmuls (None: in the weights' own dtype, fp32)
    sampler_dtype: str
    reason: str
    cpu: str | None = None  # the CPU's name and its instruction-set kind; None on a GPU
    rates: MatmulRates | None = None  # None where nothing was probed

    def as_dict(self) -> dict:
        return asdict(self)


def cpu_name() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``'s model name on Linux)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_kind() -> str:
    """The CPU's instruction-set kind as far as matmuls care: AMX, AVX512-BF16, AVX512, AVX2, or the architecture.

    From the CPU's flags (what it has); :func:`probe_matmul_rates` says what torch makes of them.
    """
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        checks = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"),
                  ("AVX512", "_is_avx512_supported"), ("AVX2", "_is_avx2_supported"))
        for name, check in checks:
            if getattr(torch.cpu, check, lambda: False)():
                return name
        return "x86-64 without AVX2"
    if machine in ("aarch64", "arm64"):
        return "Arm (BF16 extension)" if _arm_has_bf16() else "Arm"
    return machine or "unknown"


def _arm_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("Features") and " bf16" in line for line in info)
    except OSError:
        return False


def describe_cpu() -> str:
    """``"AMD EPYC (AVX512-BF16; torch kernels AVX512)"``: the name, the kind, and the vector width torch's own
    kernels use (lower than the kind where ``ATEN_CPU_CAPABILITY`` caps it), as the log, the bench and the W&B
    config show it."""
    return f"{cpu_name()} ({cpu_kind()}; torch kernels {torch.backends.cpu.get_cpu_capability()})"


def _time_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    began = time.perf_counter()
    torch.matmul(a, b)
    return time.perf_counter() - began


@functools.cache
def probe_matmul_rates(shape: tuple[int, int, int] = PROBE_SHAPE, budget_s: float = PROBE_BUDGET_S) -> MatmulRates:
    """Time ``shape`` (rows, inner, cols) in fp32 and bf16 on one thread: about 0.2 s where bf16 is native, up to a
    few seconds where it is emulated (0.1-2 GFLOP/s). Once per process (cached).

    One thread, because the ratio of the two rates is a property of the kernels, and a multi-threaded matmul
    this small collapses when another process shares the cores (a sweep's jobs on one node): measured on the
    2-core EPYC beside a 2-thread fp32 load, 2 threads read 7-13 GFLOP/s and bf16/fp32 between 1.38 and 3.4
    (one job of a sweep then settled on fp32 beside bf16 siblings), where 1 thread read 93-96 / 195-197
    GFLOP/s, 2.05-2.09x, as without the load. After one untimed call of each (creating a kernel is slow, and
    slower still while other processes compile: one job of a 4-job sweep on 2 cores read its first two bf16
    calls at 0.15x fp32), the two dtypes take turns, one matmul each per round, for at least
    :data:`PROBE_MIN_ROUNDS` rounds and while ``budget_s`` lasts; the best time of each counts.
    """
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    a16, b16 = a32.to(torch.bfloat16), b32.to(torch.bfloat16)
    best32 = best16 = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _time_matmul(a32, b32), _time_matmul(a16, b16)  # untimed: each dtype's first call creates its kernels
        start, rounds = time.perf_counter(), 0
        while rounds < PROBE_MIN_ROUNDS or time.perf_counter() - start < budget_s:
            best32 = min(best32, _time_matmul(a32, b32))
            best16 = min(best16, _time_matmul(a16, b16))
            rounds += 1
    finally:
        torch.set_num_threads(threads)
    flops = 2 * m * k * n
    return MatmulRates(fp32=flops / best32, bf16=flops / best16, shape=tuple(shape), threads=1)


def bf16_is_fast(rates: MatmulRates) -> bool:
    return rates.bf16_speedup >= BF16_MIN_SPEEDUP


def _gflops(rate: float) -> str:
    return f"{rate / 1e9:.1f} GFLOP/s"


def resolve_precision(device: str, autocast_dtype: str | None, sampler_dtype: str) -> Precision:
    """Settle ``auto`` in the two dtype keys for ``device`` (cpu | cuda); explicit values are kept.

    CPU: one probe (:func:`probe_matmul_rates`) decides both, and is also run when a key asks for bf16
    explicitly, to warn where bf16 is far slower than fp32 here. CUDA: bf16 where the GPU has it
    (Ampere and later), else fp32 matmuls for the learner (fp16 autocast would need loss scaling) and
    fp16 for the sampler.
    """
    autocast = None if autocast_dtype == "float32" else autocast_dtype
    wanted = {"hardware.autocast_dtype": autocast, "hardware.sampler_dtype": sampler_dtype}
    if device == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        if autocast == "auto":
            autocast = "bfloat16" if native else None
        if sampler_dtype == "auto":
            sampler_dtype = "bfloat16" if native else "float16"
        reason = "bf16 is native on this GPU" if native else "this GPU has no bf16: fp32 matmuls, fp16 sampler"
        return Precision(autocast, sampler_dtype, reason)

    if "auto" not in wanted.values() and "bfloat16" not in wanted.values():
        return Precision(autocast, sampler_dtype, "set in the config")
    rates = probe_matmul_rates()
    fast = bf16_is_fast(rates)
    measured = (f"bf16 matmuls {_gflops(rates.bf16)} vs fp32 {_gflops(rates.fp32)} "
                f"({rates.bf16_speedup:.2f}x) on {rates.shape[0]}x{rates.shape[1]}x{rates.shape[2]}, "
                f"{rates.threads} thread{'s' if rates.threads > 1 else ''}")
    for key, value in wanted.items():
        if value == "bfloat16" and rates.bf16_speedup < BF16_SLOW_FRACTION:
            log.warning("%s=bfloat16, but bf16 matmuls run at %s on this CPU (%s) against %s in float32, %.0fx "
                        "slower: bf16 is emulated here and the run will be very slow. %s=auto picks float32 here",
                        key, _gflops(rates.bf16), describe_cpu(), _gflops(rates.fp32), 1 / rates.bf16_speedup, key)
    chosen = "bfloat16" if fast else None
    if autocast == "auto":
        autocast = chosen
    if sampler_dtype == "auto":
        sampler_dtype = chosen or "float32"
    verdict = (f"bf16 is native (>= {BF16_MIN_SPEEDUP}x fp32)" if fast
               else f"bf16 is not faster than {BF16_MIN_SPEEDUP}x fp32 here")
    return Precision(autocast, sampler_dtype, f"{measured}: {verdict}", describe_cpu(), rates)
