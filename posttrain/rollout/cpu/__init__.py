"""CPU decode accelerators for the native engine, fenced here behind one entry point.

The native engine (`rollout/native.py`) asks this package one question — can the model run through
the fused Llama-family decoder (`fused_unsupported_reason`) — and builds a `FusedDecoder`, whose
`plan` is the pre-allocated one-token decode step. Everything below serves that step:

    fused.py            the fused decoder: norm-folded weight copies, complex RoPE, prefill, `plan`
    decode_plan.py      its one-token step, pre-allocated (PyTorch ops or the C kernels between matmuls)
    projections.py      the decode matmul forms, one class each (mm / MKL / oneDNN packed / mv / our C)
    tuning.py           which form is fastest on this machine: measured once, cached
    ckernels.py         C kernels built on first use with the system compiler, loaded with ctypes
    kernels/decode.c    attention, RMSNorm, SwiGLU and a bf16/fp32 matmul (AVX-512; plain-C fallback)

The reference beside it is the plain PyTorch step, `native.HFForward` (the model's own forward on
the same cache): `NativeEngine(kernels="hf")` switches every accelerator off, and
tests/test_rollout_cpu_fused.py proves the two agree.
"""

from posttrain.rollout.cpu.fused import FusedDecoder, fused_unsupported_reason

__all__ = ["FusedDecoder", "fused_unsupported_reason"]
