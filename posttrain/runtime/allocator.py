"""The process's host allocator policy: the largest CPU tensors in their own mappings, the rest reused in the heap.

PyTorch's CPU allocator calls the C library's `malloc` for every tensor and keeps no cache. glibc serves a
block below its mmap threshold from the heap, and that threshold is *dynamic*: it starts at 128 KiB and
rises to the size of each mapped block that is freed, up to 32 MiB. So the first steps map and fault in
blocks that later steps take from the heap, and the heap, which reuses a freed block only for a request
that fits it, grows around the ones that do not.

Fixing the threshold (`mallopt(M_MMAP_THRESHOLD, …)`, which also turns the dynamic rule off) puts every
block at or above it in its own mapping, unmapped when freed, from the first step on. What that costs is
the page faults of first touch: a mapped block is faulted in page by page every time it is allocated.
tiny-30m GRPO, bf16, one thread (`benchmarks/allocator.py`; docs/performance.md, "Memory"): at 128-token
completions a step took 5.4–5.7 s and 620,000–670,000 faults at 4 MiB (the first default) against 4.7 s
and 275,000 at 32 MiB, peaking 1,720–1,745 MiB against 1,924–1,938; at 512 tokens 29.7 s against 23.0 s,
peaking 3,379 against 4,187 MiB. The default is glibc's own ceiling, 32 MiB: blocks above it (a long
sequence's logits and attention scores) are mapped, the rest reused from the heap; `mmap_threshold_mib: 4`
buys the lower peak with that time.

Fixing the mmap threshold also freezes the trim threshold at its 128 KiB start, so a free that leaves
more than that at the heap's top hands the pages back, and the next allocation faults them in again.
`set_mmap_threshold` sets it to `keep_bytes` (1 GiB by default, the recipe's `heap_keep_mib`): the heap
keeps up to that much free memory at its top. A training step frees its activations and gradients at its
end and allocates the same sizes again in the next, so pages handed back are pages faulted in again, and
a first-touch fault is dear — ~8–11 µs a page on the machine of docs/performance.md (a 2.9 MiB gradient
cast took 8 ms with its 704 faults, 0.15 ms without). Keeping them costs nothing in peak memory (the
pages were resident at the peak anyway; measured peaks stayed within their run-to-run spread), and the
resident set stays near the peak between steps. Against twice the mmap threshold (glibc's own ratio under
its dynamic rule, the earlier setting), `benchmarks/allocator.py`: tiny-30m GRPO at 32 tokens 5,300–21,800
faults a step → 3,000–5,400, its time within noise; DPO at 1,024-token pairs 147,000–419,000 → 148,000–
296,000 (the blocks ≥ 32 MiB are mapped either way) and 27.2 / 28.1 → 26.8 / 25.6 s a step.

glibc only (Linux); elsewhere, or where the call fails, nothing changes and `set_mmap_threshold` says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
HEAP_KEEP_BYTES = 1 << 30  # the recipe's `heap_keep_mib` default


def set_mmap_threshold(nbytes: int | None, keep_bytes: int = HEAP_KEEP_BYTES) -> str | None:
    """Serve every block of ≥ `nbytes` from its own mapping, and let the heap keep up to
    max(`keep_bytes`, 2 × `nbytes`) of free memory at its top (None: leave glibc's dynamic thresholds).
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
    # the trim threshold, frozen at 128 KiB by the call above (module docstring): 15,600 faults per tiny-30m
    # update at 32 tokens with it there, 2,900 at 64 MiB
    trim = min(max(int(keep_bytes), 2 * int(nbytes)), 2**31 - 1)  # mallopt takes an int
    if mallopt(M_TRIM_THRESHOLD, trim) != 1:
        return f"mallopt(M_TRIM_THRESHOLD, {trim}) refused"
    return None
