"""The one interface every rollout backend implements, and the factory that picks one.

A stage sees an engine only through `RolloutEngine`: it samples (`generate`), pushes new weights
(`update_weights`), pads with the engine's `pad_id`, stops at its `eos_ids`, and asks it what a
generation cost (`decode_cost`, for the `generate` phase's roofline record). Nothing is reached
through an engine's model: a vLLM engine has none in this process.

Optional: a prefix cache across calls (`prefix_cache_of`). The native engine keeps the rows a caller
names (`generate(..., keep=[key or None per row])`, `release(keys)`; `prefix_cache.py`) and starts a
later prompt that extends a kept row from its keys and values. HF `generate` has none (every call
prefills everything). vLLM has its own automatic prefix caching (`enable_prefix_caching`, on by default
in `VLLMEngine`), which needs no request and is reset on every weight push.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from posttrain.rollout.hf import HFEngine
from posttrain.rollout.native import NativeEngine
from posttrain.rollout.output import Rollout
from posttrain.rollout.prefix_cache import PrefixCache
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.vllm_backend import VLLMEngine
from posttrain.telemetry.costs import Cost


class Backend(str, Enum):  # str-valued (StrEnum is 3.11+; the project supports 3.10)
    NATIVE = "native"  # our decode loop (default): CPU or GPU, any HF causal LM
    HF = "hf"          # transformers generate: the reference, and the fallback
    VLLM = "vllm"      # vLLM on a CUDA GPU (optional extra)


@runtime_checkable
class RolloutEngine(Protocol):
    name: str            # the backend: "native", "hf" or "vllm"
    pad_id: int          # the id a Rollout's pads carry; stages pad their batches with it
    eos_ids: list[int]   # ids that end a completion (kept in it)

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

    def release_memory(self) -> int:
        """Free what the engine holds between rollouts in this process (weight copies, decode forms) so
        the update's memory peak does not hold them; the next `sync_weights` rebuilds them. Returns the
        bytes freed (0: nothing to free). Stages call it after a rollout, before the update."""
        ...

    def decode_cost(self, *, batch: int, prompt_len: int, new_tokens: int, samples: int = 1) -> Cost:
        """FLOPs and bytes of generating `new_tokens` for `batch` sequences of `prompt_len` (left-padded)
        prompt tokens on this engine's model (`telemetry.costs.decode`); `samples`: the sequences are
        batch / samples prompts' samples (`SamplingParams.n`), counted as this engine runs them (each prompt
        prefilled once or per sample, its keys read once or per sample)."""
        ...


def prefix_cache_of(engine: RolloutEngine) -> PrefixCache | None:
    """The engine's prefix cache where it keeps rows between calls on request (`generate(keep=)`,
    `release`): the native engine with a nonzero `prefix_cache_bytes`; else None."""
    cache = getattr(engine, "prefix_cache", None)
    return cache if isinstance(cache, PrefixCache) and cache.max_bytes > 0 else None


def backend_unavailable_reason(backend: str | Backend) -> str | None:
    """Why `backend` cannot run on this machine (None: it can) — checked before a run starts, so a
    recipe naming vLLM on a CPU fails at once in one line rather than at its stage."""
    if Backend(backend) is not Backend.VLLM:
        return None
    if importlib.util.find_spec("vllm") is None:
        return "the vLLM backend needs the vllm package (the posttrain extra of that name; not installed here) and a CUDA GPU"
    if not torch.cuda.is_available():
        return "the vLLM backend needs a CUDA GPU (none is visible); use backend: native on a CPU"
    return None


def make_engine(backend: str | Backend, model: Any, tokenizer: PreTrainedTokenizerBase | None = None,
                **options: Any) -> RolloutEngine:
    """A rollout engine for `model`. `options` go to the backend's constructor (e.g. native: dtype=, kernels=)."""
    try:
        kind = Backend(backend)
    except ValueError:
        raise ValueError(f"unknown rollout backend {backend!r}; expected one of {[b.value for b in Backend]}") from None
    engine = {Backend.NATIVE: NativeEngine, Backend.HF: HFEngine, Backend.VLLM: VLLMEngine}[kind]
    return engine(model, tokenizer, **options)
