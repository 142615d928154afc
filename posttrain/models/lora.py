"""LoRA via PEFT, in one place: wrap a model, disable its adapters (the reference policy), merge them
(into a copy, or into a reused buffer for the decode path), save and load them in PEFT's format, and
count what trains.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", §4.1, eq. 3): an adapted
Linear computes h = W₀x + (α/r)·B·A·x with W₀ frozen, A (r, in) random, B (out, r) zero at the start,
so the adapted model starts as the base model exactly.

Departures and choices (numbered):
1. `wrap` returns the *same* Hugging Face module with PEFT's layers injected (PEFT injects in place),
   not the `PeftModel` around it: every stage keeps calling `model.config`, `model.model`, `model.score`
   and the model's own forward as in full fine-tuning. The `PeftModel` is kept beside it (`peft_of`)
   for what only it does: `disable_adapter()`, `save_pretrained`.
2. The reference policy of DPO / PPO / GRPO is the policy under `adapters_disabled` (PEFT's
   `disable_adapter()`): no second copy of the weights. Because every stage starts a fresh adapter on
   the merged weights of the stage before (3), "adapters disabled" is exactly the stage's start policy.
3. A stage after a LoRA stage starts from that stage's merged weights with a new adapter (what
   InstructGPT-style pipelines mean by "the SFT model is the reference"); a LoRA checkpoint holds only
   its adapter and names the checkpoint it adapts (`adapter_config.json` `base_model_name_or_path`),
   which may itself be an adapter checkpoint: `resolve_chain` walks it, `models.load_model` merges it.
4. The rollout engine reads merged weights without merging into the module: `merged_weight` writes
   W₀ + (α/r)·B·A of one layer into a buffer the decode path reuses (`rollout/fused.py`), so a weight
   refresh costs one rank-r matmul per adapted layer and allocates nothing after the first.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from posttrain.models import fused_lora

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT = "_posttrain_peft"  # where `wrap` keeps the PeftModel: the module's __dict__ (not a submodule)


class LoraError(ValueError):
    """A LoRA request or checkpoint that cannot be honoured (the message names the layer or file)."""


def wrap(model: nn.Module, *, r: int, alpha: float, dropout: float, target_modules: Sequence[str],
         heads: Sequence[str] = (), base: str | Path | None = None) -> nn.Module:
    """Inject fresh LoRA adapters into `model` (in place); freeze everything else. Returns `model`.

    heads: modules trained in full beside the adapters and saved with them (PEFT `modules_to_save`), e.g.
    ("score",) for a reward model's or critic's scalar head. base: the checkpoint folder `model` was
    loaded from, recorded in the adapter's config (departure 3)."""
    from peft import LoraConfig, get_peft_model

    if heads:  # a scalar model (reward model, critic) has no LM head to adapt: its head trains in full
        target_modules = [t for t in target_modules if t != "lm_head"]
    present = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, (nn.Linear, nn.Embedding))}
    missing = [t for t in target_modules if t not in present]
    if missing:
        raise LoraError(f"model.lora.target_modules: {missing} name no Linear or Embedding layer of "
                        f"{type(model).__name__} (its layers: {sorted(present)})")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        modules_to_save=list(heads) or None, bias="none",
                        task_type=None if heads or not hasattr(model, "generate") else "CAUSAL_LM")
    peft = get_peft_model(model, config)
    _attach(model, peft, base)
    return model


def load_adapter(model: nn.Module, folder: str | Path, *, trainable: bool) -> nn.Module:
    """The adapter saved in `folder` injected into `model` (its base weights), as `wrap` returns it."""
    from peft import PeftModel

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise LoraError(f"{folder}: no {ADAPTER_CONFIG}; not a LoRA adapter checkpoint")
    peft = PeftModel.from_pretrained(model, folder, is_trainable=trainable)
    _attach(model, peft, adapter_base(folder))
    return model


def _attach(model: nn.Module, peft: nn.Module, base: str | Path | None) -> None:
    if peft.get_base_model() is not model:
        raise LoraError(f"PEFT wrapped a different module than {type(model).__name__}; expected in-place injection")
    if base is not None:
        peft.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    model.__dict__[_PEFT] = peft  # a plain attribute: no submodule, so state_dict() and parameters() are unchanged
    fused_lora.install(model)  # under autocast each adapted linear is one node (models/fused_lora.py); PEFT's forward otherwise


def is_lora(model: nn.Module) -> bool:
    return _PEFT in model.__dict__


def peft_of(model: nn.Module):
    """The `PeftModel` around a model `wrap` or `load_adapter` returned."""
    if not is_lora(model):
        raise LoraError(f"{type(model).__name__} has no LoRA adapters")
    return model.__dict__[_PEFT]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model inside the block: PEFT's `disable_adapter()` (adapted layers compute W₀x only, heads
    in `modules_to_save` their original copy); restored on exit, even on error."""
    with peft_of(model).disable_adapter():
        yield model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(parameters that train, all parameters). A PEFT model counts its frozen base in the total."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


def adapter_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' own matrices (lora_A, lora_B), by name; what a LoRA step must change."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


# ---- the decode path's view: one layer's merged weight -----------------------------------------------
def _lora_layer(module: nn.Module):
    from peft.tuners.lora import LoraLayer

    return module if isinstance(module, LoraLayer) else None


def active_adapters(module: nn.Module) -> list[str]:
    """The adapters that change `module`'s output now (none when disabled, merged, or not a LoRA layer)."""
    layer = _lora_layer(module)
    if layer is None or layer.disable_adapters or layer.merged:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A or a in layer.lora_embedding_A]


def unmergeable_reason(module: nn.Module) -> str | None:
    """Why `merged_weight` cannot fold `module`'s adapters into one weight (None: it can)."""
    from peft.tuners.lora import Linear as LoraLinear

    layer = _lora_layer(module)
    if layer is None:
        return None
    if not isinstance(layer, LoraLinear):
        return f"a LoRA layer of type {type(layer).__name__} (only Linear adapters are merged)"
    for a in active_adapters(layer):
        if a in getattr(layer, "lora_variant", {}):
            return f"a LoRA variant ({type(layer.lora_variant[a]).__name__}, e.g. DoRA) whose update is not B·A"
        if layer.lora_bias.get(a, False) or layer.fan_in_fan_out:
            return "LoRA with lora_bias or fan_in_fan_out"
    return None


def merged_weight(module: nn.Module, out: Tensor | None = None) -> Tensor:
    """W₀ + Σ (α/r)·B·A over `module`'s active adapters, written into `out` when given (shape (out, in),
    W₀'s dtype), else into a new tensor. A plain Linear (or no active adapter) gives W₀ itself (a detached
    view, no copy). Shape: (out, in)."""
    weight = module.weight.detach()  # PEFT's LoRA layer exposes its base layer's weight
    adapters = active_adapters(module)
    if not adapters:
        return weight
    reason = unmergeable_reason(module)
    if reason is not None:
        raise LoraError(f"merged_weight: {reason}")
    out = torch.empty_like(weight) if out is None else out
    out.copy_(weight)
    for a in adapters:
        b, a_w = module.lora_B[a].weight.detach(), module.lora_A[a].weight.detach()  # (out, r), (r, in)
        out.addmm_(b.to(out.dtype), a_w.to(out.dtype), alpha=module.scaling[a])    # one rank-r matmul
    return out


def adapter_state(model: nn.Module) -> tuple:
    """What decides whether a merged view of `model` is stale besides its parameters: which adapters act."""
    return tuple((name, tuple(active_adapters(m))) for name, m in model.named_modules() if _lora_layer(m) is not None)


# ---- copies and checkpoints --------------------------------------------------------------------------
def merged_copy(model: nn.Module) -> nn.Module:
    """A plain Hugging Face model with the adapters merged into its weights; `model` is left as it is."""
    if not is_lora(model):
        return copy.deepcopy(model)
    plain = copy.deepcopy(peft_of(model)).merge_and_unload()
    plain.__dict__.pop(_PEFT, None)  # the copy's pointer to its (copied) PeftModel
    return plain


def save_adapter(model: nn.Module, folder: str | Path) -> None:
    """adapter_config.json + adapter_model.safetensors (PEFT's format; `PeftModel.from_pretrained(base,
    folder)` loads it) into `folder`; the caller makes it atomic."""
    peft_of(model).save_pretrained(folder, safe_serialization=True)


def adapter_base(folder: str | Path) -> Path | None:
    """The checkpoint an adapter folder adapts (None: `folder` is no adapter)."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    base = raw.get("base_model_name_or_path")
    if not base:
        raise LoraError(f"{path}: base_model_name_or_path is empty; it must name the folder the adapter was trained on")
    return Path(base)


def resolve_chain(folder: str | Path) -> tuple[Path, list[Path]]:
    """(the plain HF folder at the bottom, the adapter folders to merge on it, bottom first)."""
    adapters: list[Path] = []
    here = Path(folder)
    while (base := adapter_base(here)) is not None:
        if here in adapters:
            raise LoraError(f"{folder}: adapter chain loops at {here}")
        adapters.append(here)
        if not base.is_dir():
            raise LoraError(f"{here / ADAPTER_CONFIG}: base_model_name_or_path {str(base)!r} is not a folder "
                            "(the checkpoint the adapter was trained on has moved or been deleted)")
        here = base
    return here, adapters[::-1]


def merge_adapter(model: nn.Module, folder: str | Path) -> nn.Module:
    """`model` (the adapter's base weights) with the adapter in `folder` merged in: a plain HF module."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, Path(folder)).merge_and_unload()
