"""A lean forward for Llama-family decoders (Llama, Qwen2, Mistral without sliding window), for decoding.

It computes exactly what `LlamaForCausalLM.forward` computes — RMSNorm → attention with RoPE →
RMSNorm → SwiGLU MLP, residuals, final norm, LM head (Touvron et al. 2023, "LLaMA", §2.2) — with the
same op order in every numerically sensitive place (RMSNorm in fp32, RoPE as
`x·cos + rotate_half(x)·sin`, SDPA). It reads the HF module's own parameters and its own rotary
module, so rope scaling variants come for free.

Departures from the HF forward (numbered):
1. Q/K/V are one matmul and gate/up are one matmul: their weights are concatenated once
   (`FusedWeights`) and rebuilt only when a source parameter changes (its in-place version counter
   moves, as after an optimizer step). On a small model each saved matmul is a saved kernel launch /
   Python round trip; on a big one the larger GEMM runs closer to peak.
2. No mask factory, no output capture, no decorators: the caller hands a ready boolean key mask, and
   only the last position's logits are computed.
3. Optional weight dtype (e.g. bf16 weights for a fp32 policy): the fused copies are cast; logits
   are returned in fp32 either way.
4. GQA runs through SDPA's `enable_gqa` (no repeat_kv copy).
5. RMSNorm is `F.rms_norm` (one op instead of six; ~5× faster per call on CPU); it agrees with HF's to
   rounding (`rms_norm` keeps HF's op order as the naive version, and a test compares the two).
6. RoPE cos/sin are tabulated once per `generate` from the model's own rotary module (`prepare`).
`HFForward` in `native.py` is the naive version; `tests/test_rollout_native.py` proves they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.rollout.kv_cache import KVCache

FUSED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def fused_unsupported_reason(model: nn.Module) -> str | None:
    """None if `FusedDecoder` can run `model`, else why not (the engine then uses the HF forward)."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in FUSED_MODEL_TYPES:
        return f"model_type {mtype!r} is not one of {FUSED_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the fused MLP is SwiGLU with SiLU)"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (mtype == "mistral" and cfg.sliding_window):
        return "sliding-window attention layers"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", "default"))):
        return "dynamic RoPE scaling (its frequencies depend on the running length; the fused path tabulates them)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "module layout differs from LlamaModel (embed_tokens, layers, norm, rotary_emb)"
    if not hasattr(model, "lm_head"):
        return "no lm_head"
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm, op for op: normalise in fp32, cast back, then scale (the naive version)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_fused(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The same norm as one ATen op (departure 5); in bf16 it rounds once instead of twice."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:  # x (R, H, q, D); cos/sin (R, 1, q, D)
    """HF's `x·cos + rotate_half(x)·sin` with rotate_half(x) = [−x₂, x₁] written as roll(x)·[−sin₁, sin₂]:
    the sign moves from x to sin, which is exact in floating point, and saves the neg + cat."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass
class _Layer:
    ln1: Tensor
    wqkv: Tensor
    bqkv: Tensor | None
    wo: Tensor
    bo: Tensor | None
    ln2: Tensor
    wgu: Tensor
    wd: Tensor
    split: tuple[int, int, int]  # q, k, v widths in the fused projection


class FusedWeights:
    """Concatenated (and optionally cast) copies of a Llama-family model's weights, kept in sync."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype
        self._params = list(model.parameters())
        self._key: tuple | None = None
        self.layers: list[_Layer] = []

    def _version(self) -> tuple:
        # A parameter's `_version` moves on every in-place write (optimizer.step, load_state_dict, copy_),
        # and `data_ptr` moves when it is replaced: together they say when the copies are stale.
        return tuple((p.data_ptr(), p._version) for p in self._params)

    def refresh(self) -> None:
        """Rebuild the fused copies if any source parameter changed since the last build."""
        key = self._version()
        if key == self._key:
            return
        m, dt = self.model, self.dtype
        def cast(t: Tensor) -> Tensor:
            return t.detach() if dt is None else t.detach().to(dt)

        def cat(*ts: Tensor) -> Tensor:
            return torch.cat([cast(t) for t in ts], 0)

        self.layers = []
        for layer in m.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            biases = [p.bias for p in qkv]
            self.layers.append(_Layer(
                ln1=cast(layer.input_layernorm.weight),
                wqkv=cat(*(p.weight for p in qkv)),
                bqkv=None if all(b is None for b in biases) else cat(*(
                    b if b is not None else torch.zeros(p.weight.shape[0], dtype=p.weight.dtype, device=p.weight.device)
                    for b, p in zip(biases, qkv))),
                wo=cast(a.o_proj.weight),
                bo=None if a.o_proj.bias is None else cast(a.o_proj.bias),
                ln2=cast(layer.post_attention_layernorm.weight),
                wgu=cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                wd=cast(mlp.down_proj.weight),
                split=tuple(p.weight.shape[0] for p in qkv),
            ))
        if any(getattr(mod, "bias", None) is not None for layer in m.model.layers
               for mod in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)):
            raise ValueError("FusedWeights: MLP biases are not supported (mlp_bias=True); use kernels='hf'")
        self.embed = cast(m.model.embed_tokens.weight)
        self.norm = cast(m.model.norm.weight)
        self.lm_head = cast(m.lm_head.weight)
        self.lm_head_bias = None if getattr(m.lm_head, "bias", None) is None else cast(m.lm_head.bias)
        self._key = key


class FusedDecoder:
    """`step(ids, positions, cache, key_mask) -> last-position logits`, for Llama-family models."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        reason = fused_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FusedDecoder cannot run this model: {reason}")
        self.model = model
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.eps = model.model.layers[0].input_layernorm.variance_epsilon
        self.final_eps = model.model.norm.variance_epsilon
        self.weights = FusedWeights(model, dtype)
        self.dtype = dtype or next(model.parameters()).dtype
        self._rope_len, self._rope_device = 0, None

    def prepare(self, max_positions: int, device: torch.device) -> None:
        """Refresh the fused weights and tabulate RoPE cos/sin for positions [0, max_positions).

        The model's own rotary module fills the table (so scaled-rope variants are honoured); a step
        then gathers rows of it instead of recomputing cos/sin for every layer call.
        """
        self.weights.refresh()
        if max_positions <= self._rope_len and self._rope_device == device:
            return
        probe = torch.zeros(1, 1, 1, dtype=self.dtype, device=device)
        cos, sin = self.model.model.rotary_emb(probe, torch.arange(max_positions, device=device)[None])
        half = cos.shape[-1] // 2
        self._cos = cos[0]                                                # (L, D)
        self._sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)  # (L, D), see _rope
        self._rope_len, self._rope_device = max_positions, device

    def __call__(self, ids: Tensor, positions: Tensor, cache: KVCache, key_mask: Tensor) -> Tensor:
        """Shapes: ids/positions (R, q) long; key_mask (R, cache.length + q) bool → logits (R, V) fp32."""
        w = self.weights
        rows, q = ids.shape
        h = F.embedding(ids, w.embed)                                     # (R, q, H)
        if int(positions.max()) >= self._rope_len:
            raise RuntimeError(f"FusedDecoder: position {int(positions.max())} beyond prepare({self._rope_len})")
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # (R, 1, q, D)
        kv_len = cache.length + q
        if q == 1:
            mask = key_mask[:, None, None, :]                             # (R, 1, 1, S)
        else:  # prefill: causal over the new block, pads masked; a pad query sees itself (no empty row → no NaN)
            causal = torch.ones(q, kv_len, dtype=torch.bool, device=ids.device).tril(kv_len - q)
            eye = torch.zeros_like(causal)
            eye[:, kv_len - q:] = torch.eye(q, dtype=torch.bool, device=ids.device)
            mask = ((causal[None] & key_mask[:, None, :]) | eye[None])[:, None]   # (R, 1, q, S)
        for i, lw in enumerate(w.layers):
            x = rms_norm_fused(h, lw.ln1, self.eps)
            qkv = F.linear(x, lw.wqkv, lw.bqkv)                            # (R, q, (Hq + 2·Hkv)·D)
            qkv = qkv.view(rows, q, -1, self.head_dim).transpose(1, 2)     # (R, Hq + 2·Hkv, q, D)
            qk = _rope(qkv[:, : self.heads + self.kv_heads], cos, sin)     # RoPE on Q and K heads at once
            qs, ks = qk[:, : self.heads], qk[:, self.heads:]
            vs = qkv[:, self.heads + self.kv_heads:]
            keys, values = cache.write(i, ks, vs)                          # (R, Hkv, S, D) views
            a = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=self.scaling,
                                               enable_gqa=self.heads != self.kv_heads)
            h = h + F.linear(a.transpose(1, 2).reshape(rows, q, -1), lw.wo, lw.bo)
            x = rms_norm_fused(h, lw.ln2, self.eps)
            gate, up = F.linear(x, lw.wgu).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.wd)
        cache.advance(q)
        last = rms_norm_fused(h[:, -1], w.norm, self.final_eps)                   # (R, H)
        return F.linear(last, w.lm_head, w.lm_head_bias).float()          # (R, V)
