"""`posttrain export CHECKPOINT --merge OUT`: any checkpoint of ours as a plain Hugging Face folder.

A LoRA checkpoint holds only its adapter and names the checkpoint it adapts (`models.lora`, which may
itself be an adapter); exporting walks that chain, merges every adapter into the weights and writes an
ordinary safetensors folder with the tokenizer, which `AutoModelForCausalLM.from_pretrained` (or, for
a reward model, `AutoModelForSequenceClassification`, with its `reward_norm.json` beside it) loads with
no PEFT installed. A full fine-tuning checkpoint is copied the same way (its weights re-saved).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from posttrain.models import lora
from posttrain.models.heads import REWARD_NORM_FILE, is_reward_model, load_scalar_model
from posttrain.models.loading import ModelLoadError, load_model, load_tokenizer


def export_merged(checkpoint: str | Path, out: str | Path) -> Path:
    """Write `checkpoint` with its adapters merged to `out` (which must not exist), atomically. Returns `out`."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise ModelLoadError(f"{checkpoint}: checkpoint folder does not exist")
    if out.exists():
        raise ModelLoadError(f"{out}: already exists; export writes a new folder")
    if lora.adapter_base(checkpoint) is None and not (checkpoint / "config.json").is_file():
        raise ModelLoadError(f"{checkpoint}: neither a Hugging Face model folder (config.json) nor a LoRA "
                             f"checkpoint ({lora.ADAPTER_CONFIG})")
    reward = is_reward_model(checkpoint)
    model = load_scalar_model(checkpoint) if reward else load_model(checkpoint)
    if lora.is_lora(model):
        raise lora.LoraError(f"{checkpoint}: the loaded model still has adapters after merging")
    tokenizer = load_tokenizer(checkpoint)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        model.config.name_or_path = str(out)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if reward:
            shutil.copy(checkpoint / REWARD_NORM_FILE, tmp / REWARD_NORM_FILE)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
