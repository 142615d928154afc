"""The vector math primed before a process computes: a fresh process's first parallel cos equals its later ones.

Without `use_threads`, 2 to 3 fresh processes in 40 run one after another got their first parallel cos
wrong by up to 1.5e-4 on one thread's share (posttrain/models/cpu_math.py), none of 24 run two at a time
(the race needs an idle core). The 16 processes here run one after another; without the priming at least
one would fail with probability ~0.6, so a failure is real and a pass is evidence, not proof. Each loads
the module by its path, not through `posttrain.models` (whose imports take seconds).
"""

from __future__ import annotations

import subprocess
import sys

import torch

import posttrain.models.cpu_math as cpu_math

# The rotary embedding's angles for 70 positions × 128 dimensions, as the resumed run's first forward had them;
# cos is the process's first parallel op (everything before it is below PyTorch's parallel grain).
FIRST_FORWARD = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("cpu_math", {cpu_math.__file__!r})
cpu_math = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_math)
cpu_math.use_threads(2)
inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
emb = torch.cat((torch.arange(70)[None, :, None].float() * inv,) * 2, dim=-1)
first, later = emb.cos(), emb.cos()
err = (first.double() - emb.double().cos()).abs().max().item()
print(torch.equal(first, later), err)
"""


def test_every_primed_op_runs_in_its_domain():
    cpu_math.prime.cache_clear()
    cpu_math.prime()
    x = torch.full((16,), 0.5)
    assert all(torch.isfinite(getattr(torch, op)(x)).all() for op in cpu_math.VML_OPS)


def test_a_fresh_process_first_parallel_cos_is_exact():
    def one():
        r = subprocess.run([sys.executable, "-c", FIRST_FORWARD], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        same, err = r.stdout.split()
        return same == "True", float(err)

    results = [one() for _ in range(16)]
    assert all(same and err < 1e-6 for same, err in results), results
