"""Process memory on CPU: glibc's allocator kept from unmapping what each step reuses, freed pages handed back
once per step, a dead buffer's pages discarded, and the matmul kernel caches bounded. Used by the learner and the
vLLM sampler; each is a no-op where glibc is not the C library (macOS, musl).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _glibc():
    """glibc's C library, or None where it is not the allocator (macOS, musl); looked up once."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back to the OS.

    Each step frees and re-allocates the same few GB (activations, LM-head chunks); by default glibc
    unmaps blocks over its mmap threshold and trims the heap, so the next step page-faults them in
    again (learner alone at 4x8x64, measured with the equivalent MALLOC_*_ environment
    variables: median step 4.8 s -> 4.0 s). Returns False where glibc is not the allocator (macOS, musl).
    See :func:`release_freed_memory` for the other half.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (m_mmap_threshold, 1 << 30), (m_trim_threshold, 2**31 - 1), (m_top_pad, 64 << 20)))


# oneDNN's primitive cache and ideep's kernel cache hold one compiled kernel per matmul shape, 1024 each by default.
# RL batches change the learner's row width every step, so every step adds kernels that are rarely used again:
# learner alone, 40 steps at 8x8x32, RSS after each step grew 2.08 -> 2.97 GiB (peak 4.07); with both at 64
# it stays at 2.10 from step 8 on (peak 3.19), no slower
KERNEL_CACHE_CAPACITY = 64


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Cap the CPU matmul kernel caches at ``capacity`` entries, unless the environment already sets them.

    Both libraries read these variables when they first build a kernel, so this must run before the
    process's first CPU matmul; later it changes nothing. Returns the variables as they now are.
    """
    names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    return {name: os.environ.setdefault(name, str(capacity)) for name in names}


def release_freed_memory() -> bool:
    """Hand the pages of freed blocks back to the OS once per step (glibc ``malloc_trim``).

    With :func:`keep_freed_memory` alone, the sampler's and the learner's allocations interleave in
    the heap and the holes between them do not fit the next step's tensors, so the heap grows every
    step (default run, 30 steps: peak RSS 3.8 -> 7.5 GiB). Trimming once after each update keeps the
    within-step reuse and stops most of that growth (14 steps: 5.6 -> 5.05 GiB; median learner step
    5.5 -> 5.6 s, the pages fault in again). Returns False where glibc is not the allocator.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def discard_pages(storage: torch.UntypedStorage) -> int:
    """Hand the whole pages of a CPU tensor's storage back to the OS (Linux ``madvise(MADV_DONTNEED)``).

    The storage stays allocated; its pages read as zeros when next touched. Only for memory whose
    contents are no longer needed. Returns the bytes handed back (0 where glibc is not the C library).
    """
    libc = _glibc()
    if libc is None or storage.device.type != "cpu":
        return 0
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-storage.data_ptr() // page) * page  # whole pages inside the block: rounded in at both ends
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end <= start:
        return 0
    madv_dontneed = 4
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_dontneed) != 0:
        return 0
    return end - start
