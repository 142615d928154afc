"""The process's host allocator policy: large CPU tensors in their own mappings, so freed memory leaves.

PyTorch's CPU allocator calls the C library's `malloc` for every tensor and keeps no cache. glibc serves a
block below its mmap threshold from the heap, and that threshold is *dynamic*: it starts at 128 KiB and
rises to the size of each mapped block that is freed, up to 32 MiB. After the first training step, then,
the activations of a long sequence (tensors of 1–32 MiB) come from the heap; a freed block is reused only
by a request that fits it, the heap grows around the ones that do not, and its free pages are not
returned. The resident set climbs step after step: a GRPO step on tiny-30m at 512-token completions
peaked at 3,601 → 4,191 → 4,514 MiB over its first three steps, holding 2.6–4.1 GB between updates.

Fixing the threshold (`mallopt(M_MMAP_THRESHOLD, …)`, which also turns the dynamic rule off) puts every
block at or above it in its own mapping, unmapped when freed: the same run peaked at 3,224 → 3,499 →
3,521 MiB and fell back to ~1.1 GB between updates (docs/performance.md, "Memory"). The cost is one
mmap/munmap and the page faults of first touch per large tensor — small next to the arithmetic that fills
it; blocks below the threshold (most of a small model's) are served from the heap as before.

glibc only (Linux); elsewhere, or where the call fails, nothing changes and `set_mmap_threshold` says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def set_mmap_threshold(nbytes: int | None) -> str | None:
    """Serve every block of ≥ `nbytes` from its own mapping (None: leave glibc's dynamic threshold).
    Returns None when set, else why not (not glibc, the call refused)."""
    if nbytes is None:
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc: the C library has no mallopt"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, int(nbytes)) != 1:  # glibc returns 1 on success
        return f"mallopt(M_MMAP_THRESHOLD, {int(nbytes)}) refused"
    return None
