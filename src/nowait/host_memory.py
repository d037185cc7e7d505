"""Keep freed memory in the process, so a CPU forward's temporaries stop paying page faults.

PyTorch allocates CPU tensors with the C library's `malloc`. glibc's defaults hand memory back
to the kernel eagerly: a block above `M_MMAP_THRESHOLD` (128 KiB at start, raised on the fly)
gets mappings of its own, and once more than `M_TRIM_THRESHOLD` sits free at the top of the
heap it is returned. A forward allocates and frees its activations every step (a few MB at a
batch of 64: the MLP's [rows, intermediate], the attention scores), so every step maps those
pages again and faults each one in, zero-filled by the kernel. Measured on the bundled `ar`
model, one thread: an RMSNorm over 2,250 rows took 1.9 ms with the defaults and 0.21 ms with
freed memory kept; `bench batching --concurrency 64` ran 15-18% faster (docs/bench.md,
"Freed memory kept in the process").

This is the setting PyTorch's CPU performance guide reaches with jemalloc or tcmalloc, done with
the allocator already loaded: `mallopt` through ctypes, once, at the start of a command or a
fleet replica. It changes no result, only when memory goes back to the kernel: the heap keeps
up to `TRIM_THRESHOLD_BYTES` free (the process's resident size stays near its high-water mark,
as it would under those allocators; so does each thread's arena). `NOWAIT_KEEP_FREED_MEMORY=0` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# glibc's own cap for its dynamic threshold on a 64-bit system, and half a thread arena's 64 MiB
# heap: blocks up to this come from the heap and are reused; larger ones (a KV cache pool, a
# checkpoint) still get mappings of their own and go back to the kernel when freed.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# How much free memory the top of the heap may hold before glibc returns it: several steps'
# temporaries at the largest batches measured, a bound on what the process keeps.
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024

# What the heap grows by beyond each request: set after start, the thresholds alone leave a heap
# whose free blocks lie between live ones, and a step's temporaries then grow it into fresh
# pages (faulted in) again; growing in large steps keeps room at the top for them.
TOP_PAD_BYTES = 64 * 1024 * 1024

ENV_SWITCH = "NOWAIT_KEEP_FREED_MEMORY"

_applied: bool | None = None


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment leaves the setting on (anything but 0, false, no or off)."""
    value = (environ if environ is not None else os.environ).get(ENV_SWITCH, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


def keep_freed_memory() -> bool:
    """Set glibc's trim and mmap thresholds once per process; True when they are set (a glibc
    Linux system and the switch on), False otherwise. Safe to call again: the first answer holds."""
    global _applied
    if _applied is None:
        _applied = wanted() and _set_thresholds()
    return _applied


def _set_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False  # musl, macOS, Windows: other allocators, other knobs
    try:
        # The glibc already loaded (its soname on every glibc Linux); find_library would run
        # ldconfig, a subprocess at every command's start.
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Each answers 1 when it took the value. The mmap threshold first: refused, nothing else is
    # set, and glibc's defaults hold whole.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
                and mallopt(M_TOP_PAD, TOP_PAD_BYTES))
