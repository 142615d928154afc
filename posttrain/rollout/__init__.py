"""The rollout engine: batched sampling with per-token log-probs behind one interface.

    engine = make_engine("native" | "hf" | "vllm", model, tokenizer)
    rollout = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=64))
    engine.update_weights(model)   # after each policy update (no copy when the module is shared)

Modules: `sampling` (SamplingParams, the sampler), `output` (Rollout), `text` (prompts, stop strings),
`kv_cache` (pre-allocated cache), `fused` (lean Llama-family forward), `native` (decode loop),
`hf` (transformers generate, the reference), `vllm_backend` (GPU only, untested here), `engine`.
"""

from posttrain.rollout.engine import Backend, RolloutEngine, make_engine
from posttrain.rollout.hf import HFEngine
from posttrain.rollout.native import NativeEngine
from posttrain.rollout.output import FinishReason, Rollout
from posttrain.rollout.sampling import SamplingParams

__all__ = ["Backend", "FinishReason", "HFEngine", "NativeEngine", "Rollout", "RolloutEngine", "SamplingParams",
           "make_engine"]
