"""The rollout engine: batched sampling with per-token log-probs behind one interface.

    engine = make_engine("native" | "hf" | "vllm", model, tokenizer)
    rollout = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=64))
    engine.update_weights(model)   # after each policy update (no copy when the module is shared)

A stage sees only the `RolloutEngine` protocol: `generate`, `update_weights`, `pad_id`, `eos_ids`,
`decode_cost` (and, optionally, a prefix cache across calls: `prefix_cache_of`). Modules: `sampling`
(SamplingParams, the sampler), `output` (Rollout), `text` (prompts, stop strings), `kv_cache`
(pre-allocated cache), `prefix_cache` (rows kept between calls), `native` (decode loop; `HFForward`, the
plain PyTorch step), `cpu/` (the CPU decode accelerators behind one entry point: the fused Llama-family decoder, its
matmul forms, tuner and C kernels), `hf` (transformers generate, the reference), `vllm_backend` (GPU
only, untested here), `engine` (the protocol and `make_engine`), `greedy` (timed greedy completions).
"""

from posttrain.rollout.engine import Backend, RolloutEngine, make_engine, prefix_cache_of
from posttrain.rollout.hf import HFEngine
from posttrain.rollout.native import NativeEngine
from posttrain.rollout.output import FinishReason, Rollout
from posttrain.rollout.sampling import SamplingParams

__all__ = ["Backend", "FinishReason", "HFEngine", "NativeEngine", "Rollout", "RolloutEngine", "SamplingParams",
           "make_engine", "prefix_cache_of"]
