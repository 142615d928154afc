"""Load any local Hugging Face causal-LM folder, and save one that plain `transformers` loads back."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ModelLoadError(ValueError):
    """A model folder that is missing or is not a causal-LM checkpoint."""


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(path: str | Path, *, dtype: str = "fp32", device: str | torch.device = "cpu") -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` on a local folder, with a clear error when it is not one."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype), local_files_only=True)
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
    """safetensors weights + config + tokenizer into `path` (the caller makes it atomic)."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
