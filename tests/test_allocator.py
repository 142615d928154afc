"""The host allocator policy (posttrain/runtime/allocator.py): with the mmap threshold fixed, a freed
large tensor's pages leave the process; with glibc's dynamic threshold they stay in the heap. Below the
threshold, the heap keeps what it frees up to `keep_bytes`, and hands the rest back."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from posttrain.runtime.allocator import set_mmap_threshold

# In a fresh interpreter: free one 8 MiB tensor (glibc's dynamic threshold rises to 8 MiB), then hold
# 100 tensors of 2 MiB and free every other one. Prints the MiB the resident set fell by.
PROBE = """
import sys, torch, psutil
from posttrain.runtime.allocator import set_mmap_threshold
if sys.argv[1] == "fixed":
    assert set_mmap_threshold(1 << 20) is None
rss = lambda: psutil.Process().memory_info().rss / 2**20
del_me = torch.ones(2 << 20)   # 8 MiB, mapped; freeing it lifts the dynamic threshold above 2 MiB
del del_me
held = [torch.ones(1 << 19) for _ in range(100)]   # 100 × 2 MiB, touched
before = rss()
del held[::2]
print(before - rss())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_fixed_threshold_returns_freed_tensors_and_dynamic_does_not():
    fell = {mode: float(subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("fixed", "dynamic")}
    assert fell["fixed"] > 80, fell      # 50 × 2 MiB = 100 MiB unmapped at once
    assert fell["dynamic"] < 40, fell    # the same blocks sit in the heap: the holes between held ones stay resident


def test_none_leaves_the_allocator_alone():
    assert set_mmap_threshold(None) is None


# In a fresh interpreter, mmap threshold 1 MiB, the heap told to keep argv[1] bytes: malloc 100 blocks of
# 512 KiB (heap blocks, touched), free them all. Prints, in MiB: how far the resident set fell, how far the
# heap's sbrk'd arena shrank, and the free top chunk left (what a trim could still hand back). PyTorch's CPU
# allocator calls the same malloc; the probe calls it directly, keeps the pointers in an array allocated
# beforehand and reads the resident set through a file opened beforehand, so that nothing it allocates on
# the way lands among the blocks and pins them below the heap's top.
KEEP_PROBE = """
import ctypes, json, os, sys
from posttrain.runtime.allocator import set_mmap_threshold
assert set_mmap_threshold(1 << 20, int(sys.argv[1])) is None
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
statm, page = os.open("/proc/self/statm", os.O_RDONLY), os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(os.pread(statm, 100, 0).split()[1]) * page / 2**20
rss()
held = (ctypes.c_void_p * 100)()   # the pointers' array, allocated before the blocks: a growing list's would land among them
for i in range(100):
    held[i] = libc.malloc(512 << 10)
    ctypes.memset(held[i], 1, 512 << 10)
before, arena = rss(), libc.mallinfo2().arena
for i in range(100):
    libc.free(held[i])
after = libc.mallinfo2()
print(json.dumps([before - rss(), (arena - after.arena) / 2**20, after.keepcost / 2**20]))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_heap_keeps_freed_blocks_up_to_keep_bytes():
    out = {keep: json.loads(subprocess.run([sys.executable, "-c", KEEP_PROBE, str(keep)], capture_output=True,
                                           text=True, check=True).stdout) for keep in (2 << 20, 1 << 30)}
    (fell_small, shrank_small, _), (fell_large, shrank_large, top_large) = out[2 << 20], out[1 << 30]
    assert shrank_small > 40 and fell_small > 40, out   # 50 MiB freed at the heap's top, all but 2 MiB handed back
    assert shrank_large < 5 and fell_large < 5, out     # kept for the next step's tensors ...
    assert top_large > 40, out                          # ... as the free top chunk
