"""The one interface every rollout backend implements, and the factory that picks one."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from posttrain.rollout.output import Rollout
from posttrain.rollout.sampling import SamplingParams


class Backend(str, Enum):  # str-valued (StrEnum is 3.11+; the project supports 3.10)
    NATIVE = "native"  # our decode loop (default): CPU or GPU, any HF causal LM
    HF = "hf"          # transformers generate: the reference, and the fallback
    VLLM = "vllm"      # vLLM on a CUDA GPU (optional extra)


@runtime_checkable
class RolloutEngine(Protocol):
    name: str

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str], params: SamplingParams) -> Rollout:
        """Sample params.n completions per prompt; rows are prompt-major (see `Rollout`)."""
        ...

    def update_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> None:
        """Make the next `generate` use these weights (lazily: the move may happen inside it)."""
        ...

    def sync_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> int:
        """Move these weights into the engine now; returns the bytes moved. Stages call it after every
        optimizer step inside their `sync` phase, so the move is timed apart from `generate`."""
        ...


def make_engine(backend: str | Backend, model: Any, tokenizer: PreTrainedTokenizerBase | None = None,
                **options: Any) -> RolloutEngine:
    """A rollout engine for `model`. `options` go to the backend's constructor (e.g. native: dtype=, kernels=)."""
    try:
        kind = Backend(backend)
    except ValueError:
        raise ValueError(f"unknown rollout backend {backend!r}; expected one of {[b.value for b in Backend]}") from None
    if kind is Backend.NATIVE:
        from posttrain.rollout.native import NativeEngine

        return NativeEngine(model, tokenizer, **options)
    if kind is Backend.HF:
        from posttrain.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, **options)
    from posttrain.rollout.vllm_backend import VLLMEngine

    return VLLMEngine(model, tokenizer, **options)
