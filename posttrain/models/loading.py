"""Load any local Hugging Face causal-LM folder, and save one that plain `transformers` loads back."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models import fused_attention, fused_mlp, fused_norm, lora

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ModelLoadError(ValueError):
    """A model folder that is missing or is not a causal-LM checkpoint."""


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


# On a CPU with bf16 autocast, PyTorch's fused SDPA kernels lose to plain (eager) attention for short
# contexts: forward + backward of tiny-30m at 16 × 52 tokens takes 458 ms with SDPA vs 352 ms eager,
# at 8 × 256 tokens 1,182 vs 906, tiny-1m at 32 × 128 244 vs 155; at 2 × 1,024 SDPA wins (1.6 vs 3.1 s).
# In fp32 the two are within a few percent either way, and SFT's padded micro-batches ran slower eager,
# so fp32 keeps SDPA (2 CPU threads, torch 2.13; docs/rlvr.md, "Speed against TRL").
EAGER_MAX_POSITIONS_CPU = 512
ATTENTION = ("auto", "sdpa", "eager")


def choose_attention(requested: str, device: str | torch.device, max_positions: int | None,
                     autocast_dtype: torch.dtype | None = None) -> str | None:
    """The attention implementation to run: `requested`, or for "auto" eager on a CPU under bf16
    autocast when the model's context is at most `EAGER_MAX_POSITIONS_CPU`, else None (the model's
    own default, SDPA)."""
    if requested not in ATTENTION:
        raise ValueError(f"unknown attention {requested!r}; expected one of {ATTENTION}")
    if requested != "auto":
        return requested
    short = max_positions is not None and max_positions <= EAGER_MAX_POSITIONS_CPU
    cpu_bf16 = torch.device(device).type == "cpu" and autocast_dtype == torch.bfloat16
    return "eager" if short and cpu_bf16 else None


def load_model(path: str | Path, *, dtype: str = "fp32", device: str | torch.device = "cpu",
               attention: str = "auto", autocast_dtype: torch.dtype | None = None) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` on a local folder, with a clear error when it is not one.

    attention: "sdpa", "eager", or "auto" (`choose_attention`, which also reads the autocast dtype
    the model will train under). A model that will run under autocast gets its RMSNorms, gated MLPs and
    attentions' rotary embeddings fused (`fused_norm`, `fused_mlp`, `fused_attention`: the same forward, less
    memory and time under autocast)."""
    path = Path(path)
    if lora.adapter_base(path) is not None:  # a LoRA checkpoint: its base (chain) with every adapter merged
        base, adapters = lora.resolve_chain(path)
        model = load_model(base, dtype=dtype, device=device, attention=attention, autocast_dtype=autocast_dtype)
        for folder in adapters:
            model = lora.merge_adapter(model, folder)
        model.config.name_or_path = str(path)
        return model
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype), local_files_only=True)
    impl = choose_attention(attention, device, getattr(model.config, "max_position_embeddings", None), autocast_dtype)
    if impl is not None and model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)
    if autocast_dtype is not None:
        fused_norm.install(model)
        fused_mlp.install(model)
        fused_attention.install(model)
    return model.to(device)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: tokenizer folder does not exist")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        # Many base checkpoints ship without a pad token; padding is always masked, so EOS serves.
        tok.pad_token = tok.eos_token
    return tok


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> None:
    """safetensors weights + config + tokenizer into `path` (the caller makes it atomic); a LoRA model
    saves its adapter only, in PEFT's format, naming its base (`models.lora`)."""
    if lora.is_lora(model):
        lora.save_adapter(model, path)
    else:
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
