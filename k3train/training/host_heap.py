"""The C heap of a CPU run: keep the memory torch frees for the next tensor of the step.

torch's CPU tensors come from glibc's `malloc`. Out of the box glibc hands every block above its
mmap threshold (128 KiB at start, raised dynamically to the largest block freed so far, at most
32 MiB) to the kernel with `munmap` when it is freed, and trims free memory off the top of the
heap beyond twice that threshold. A training step allocates and frees the same few hundred
large activations every step, so each one comes back as fresh pages, and a first touch of a
fresh 4 KiB page costs a page fault (a few microseconds on a virtual machine, as much as writing
the page several times). k3train's bf16 step, whose expert buffers change size with the routing,
faulted 9,000-24,000 pages per step at steady state and ran about 5% slower than with the
freed memory kept (docs/performance.md has the measurement).

`keep_freed_memory` sets the two limits that decide it, through glibc's `mallopt`: the mmap
threshold to 1 GiB (blocks below it come from the heap and return to it when freed; where
glibc refuses that value, 32 MiB, its dynamic maximum) and the trim
threshold to 1 GiB (free memory at the heap's top stays until there is that much of it). Both
must be set: a fixed trim threshold alone switches off the dynamic mmap threshold and leaves it
at 128 KiB, which mmaps nearly every tensor (hundreds of thousands of faults per step). The
process's peak resident memory stays what the step needs (the heap keeps what it held at its
peak, which it reaches every step anyway). Elsewhere (musl, macOS, Windows) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["configure_host_heap", "keep_freed_memory"]

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

KEPT_BYTES = 1 << 30  # blocks below this stay in the heap; this much free top is kept
DYNAMIC_MAXIMUM_BYTES = 32 << 20  # glibc's own ceiling for the mmap threshold on 64-bit machines


def _glibc():
    """The process's glibc (`mallopt` and `gnu_get_libc_version`), or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(libc=None) -> str | None:
    """Set glibc's mmap and trim thresholds (module docstring); the one line that says so, or
    None where the C library is not glibc or refuses both values. `libc`: the library (tests)."""
    libc = _glibc() if libc is None else libc
    if libc is None:
        return None
    mmap_threshold = next(
        (size for size in (KEPT_BYTES, DYNAMIC_MAXIMUM_BYTES) if libc.mallopt(M_MMAP_THRESHOLD, size) == 1), None
    )
    if mmap_threshold is None:
        return None
    # Only after the mmap threshold is fixed (see the module docstring).
    if libc.mallopt(M_TRIM_THRESHOLD, KEPT_BYTES) != 1:
        return None
    version = libc.gnu_get_libc_version().decode()
    return (
        f"host heap: freed memory kept for reuse (glibc {version}: mmap threshold {mmap_threshold >> 20} MiB, "
        f"trim threshold {KEPT_BYTES >> 20} MiB; train.host_heap=system leaves glibc's defaults)"
    )


def configure_host_heap(setting: str, device_type: str) -> str | None:
    """`train.host_heap` for a run on `device_type`: `keep_freed` keeps freed memory on a CPU run
    (a GPU run's tensors are not on this heap: nothing changes); `system` changes nothing."""
    if setting == "system" or device_type != "cpu":
        return None
    return keep_freed_memory()
