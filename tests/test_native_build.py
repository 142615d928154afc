"""What every hand-written kernel library (`posttrain.native`) shares: a failed build leaves None and warns once,
naming what falls back to PyTorch's ops, and then every `usable` check says no; `POSTTRAIN_C_KERNELS=0` turns it
off without a build. Each library's own results are tested in tests/test_native_<name>.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from posttrain import native
from posttrain.native import logprobs, rmsnorm, rope, softmax, swiglu, widen


def _softmax_args():
    return torch.zeros(1, 1, 2, 3, dtype=torch.bfloat16), torch.full((1, 2), 3, dtype=torch.int32)


LIBRARIES = {  # module: (what the warning names, arguments its `usable` takes where the library is there)
    softmax: ("softmax", _softmax_args),
    swiglu: ("gated-MLP", lambda: (torch.zeros(2, 4, dtype=torch.bfloat16),) * 2),
    rmsnorm: ("RMSNorm", lambda: (torch.zeros(2, 4), torch.ones(4), torch.ones(2, 1), torch.zeros(2, 4))),
    rope: ("rotary embedding", lambda: (torch.zeros(1, 3, 8, dtype=torch.bfloat16), torch.ones(1, 3, 4),
                                        torch.zeros(1, 3, 4), 4)),
    logprobs: ("log-prob", lambda: (torch.zeros(1, 2, 5),)),
    widen: ("bf16-to-fp32 widening", lambda: (torch.zeros(widen.MIN_ELEMENTS, dtype=torch.bfloat16), torch.float32)),
}


@pytest.mark.parametrize("module", list(LIBRARIES), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_failed_build_falls_back_with_a_warning_and_the_switch_turns_it_off(module, tmp_path, monkeypatch):
    what, args = LIBRARIES[module]
    if module.library() is not None:  # where it builds, `usable` takes these arguments (the check below can fail)
        assert module.usable(*args()) is not None
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(module.LIBRARY, "_loaded", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert module.library() is None
        assert module.library() is None  # remembered: built once, warned once
    assert [str(w.message) for w in seen if f"C {what} kernels are unavailable" in str(w.message)] != []
    assert sum(f"C {what} kernels" in str(w.message) for w in seen) == 1
    assert module.usable(*args()) is None
    monkeypatch.setattr(module.LIBRARY, "_loaded", {})
    monkeypatch.delenv("CC")
    monkeypatch.setenv(native.ENV_DISABLE, "0")
    assert module.library() is None
    assert module.LIBRARY._loaded == {}  # off: not even built
