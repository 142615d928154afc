"""Tiny causal LMs built from a config, for the demo, the tests and the benchmarks.

Presets are ordinary `transformers` architectures (Llama, Qwen2), so everything downstream — our
rollout engine, the telemetry's FLOP accounting, `from_pretrained` — treats them like any real
checkpoint. Sizes are named for their parameter count at the demo's vocabulary (~500 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config, AutoModelForCausalLM


@dataclass(frozen=True)
class TinySpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tie_embeddings: bool


PRESETS: dict[str, TinySpec] = {
    # ≈ 0.49M: about half the demo's model — the student of the distillation experiment (docs/distillation.md).
    "tiny-500k": TinySpec(hidden=96, layers=4, heads=4, kv_heads=4, intermediate=256, tie_embeddings=True),
    # ≈ 0.9M parameters at vocab 512: the demo's model (fast enough to pretrain on 2 CPU cores).
    "tiny-1m": TinySpec(hidden=128, layers=4, heads=4, kv_heads=4, intermediate=352, tie_embeddings=True),
    # ≈ 3M: a middle size for experiments.
    "tiny-4m": TinySpec(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=704, tie_embeddings=True),
    # ≈ 30M with GQA and untied embeddings: the benchmark size.
    "tiny-30m": TinySpec(hidden=512, layers=10, heads=8, kv_heads=4, intermediate=1408, tie_embeddings=False),
}

ARCHITECTURES = ("llama", "qwen2")


def tiny_config(
    preset: str,
    *,
    vocab_size: int,
    max_seq_len: int = 256,
    arch: str = "llama",
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> PretrainedConfig:
    """The `transformers` config of a preset. Raises `ValueError` naming the valid choices."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; expected one of {sorted(PRESETS)}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {list(ARCHITECTURES)}")
    s = PRESETS[preset]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=s.tie_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    if arch == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    return Qwen2Config(**common, use_sliding_window=False)


def build_tiny(preset: str, *, vocab_size: int, seed: int = 0, **config_kwargs) -> PreTrainedModel:
    """A randomly initialised tiny model (deterministic for a seed)."""
    config = tiny_config(preset, vocab_size=vocab_size, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
