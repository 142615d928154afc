"""Analytic FLOP and byte accounting for dense decoder-only transformers (Llama / Qwen2 / Mistral).

Sources:
- FLOPs: Chowdhery et al. 2022, "PaLM", appendix B: model FLOPs per token = 6N + 12·L·H·Q·T for a
  training step (N non-embedding-lookup parameters, L layers, H heads, Q head size, T context). That
  is 2 FLOPs per multiply-accumulate for every matmul, forward, and 2× the forward for the backward
  (one matmul for the input gradient, one for the weight gradient). We count the same matmuls, but per
  projection so that GQA (fewer K/V heads), a SwiGLU MLP (three matrices) and the LM head are exact.
- Bytes for decode: the memory-bandwidth-utilization (MBU) definition used for LLM inference
  (Databricks/MosaicML, "LLM Inference Performance Engineering: Best Practices", 2023): bytes moved
  per decode step = bytes of all weights + bytes of the KV cache read, divided by the step time,
  against the peak bandwidth.

What is counted (FLOPs): every matrix multiply, at 2 FLOPs per multiply-accumulate — the Q/K/V/O
projections, the gate/up/down MLP matrices, the LM head (or a scalar head), and the two attention
matmuls (scores = Q·Kᵀ and output = P·V). What is not counted: elementwise work (RMSNorm, RoPE,
SiLU, softmax, residual adds, bias adds, the loss), embedding lookups. This is exactly what
`torch.utils.flop_counter.FlopCounterMode` counts for the eager attention path (`aten.mm` +
`aten.bmm`), and the test validates against it.

Departures (numbered):
1. Attention is counted dense over the causal square (T × S), as PaLM does and as FlopCounterMode
   does, not the ~½ a causal kernel that skips masked blocks actually performs. Note that on CPU,
   FlopCounterMode does not count SDPA's fused kernel at all; the counts here always include it.
2. Training = forward + 2× forward (backward), plus one more forward when activations are
   recomputed (gradient checkpointing). The embedding matrix gets a gradient but no matmul.
3. Bytes are a minimum-traffic model, not a cache simulation: every weight is read once per forward
   (again in the backward, and the weight gradient is written once), each matmul reads its input
   activation and writes its output once, attention reads Q, K, V and writes its output once (fused
   kernel: the T × S score matrix never reaches memory), the KV cache is written once per new token
   and read in full per decode step. AdamW reads param, grad, m, v and writes param, m, v (7 tensors
   the size of the parameters). Real traffic is higher where tensors fall out of cache and lower
   where small weights stay in cache (CPU: a 1M-parameter model lives in L2/L3).
4. Generation = one prefill of the prompt (logits for the last position only, as `generate` does)
   + (new_tokens − 1) decode steps, the j-th step attending to prompt_len + j keys; the sum over
   steps is taken in closed form (`_generate_naive` keeps the loop, and a test proves they agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Logits = Literal["all", "last", "scalar"]

_DTYPE_BYTES: dict[str, int] = {
    "fp64": 8, "float64": 8, "fp32": 4, "float32": 4, "float": 4, "tf32": 4,
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


@dataclass(frozen=True)
class Cost:
    """Work done by a block of code: floating-point operations and bytes moved to/from memory."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        if not isinstance(other, Cost):
            return NotImplemented
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __radd__(self, other: object) -> Cost:
        # lets sum([...]) start from 0
        if other == 0:
            return self
        return NotImplemented  # type: ignore[return-value]

    def __mul__(self, k: float) -> Cost:
        return Cost(self.flops * k, self.bytes * k)

    __rmul__ = __mul__

    @property
    def intensity(self) -> float | None:
        """Arithmetic intensity in FLOP/byte; None when no bytes were counted."""
        return self.flops / self.bytes if self.bytes > 0 else None


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical short name ('fp32', 'bf16', 'fp16', …) of a torch dtype or a string alias."""
    name = str(dtype).removeprefix("torch.")
    canon = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
             "float64": "fp64", "double": "fp64"}
    name = canon.get(name, name)
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of fp32, bf16, fp16, fp8, int8 "
                         f"(or a torch.dtype)")
    return name


def bytes_per_element(dtype: torch.dtype | str) -> int:
    """Bytes per element: fp32 → 4, bf16/fp16 → 2, fp8/int8 → 1."""
    return _DTYPE_BYTES[dtype_name(dtype)]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the accounting needs, read once from a Hugging Face config.

    `qkv_bias` / `o_bias` / `mlp_bias` only change the parameter count (bias adds are elementwise).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read a `transformers.PretrainedConfig` (Llama / Qwen2 / Mistral families) or pass a ModelShape through."""
        if isinstance(config, ModelShape):
            return config
        where = f"{type(config).__name__} (model_type={getattr(config, 'model_type', '?')!r})"
        for moe_field in ("num_local_experts", "num_experts", "n_routed_experts"):
            if getattr(config, moe_field, None):
                raise ValueError(f"{where}: has {moe_field}={getattr(config, moe_field)}; the accounting "
                                 "covers dense models only (mixture-of-experts is not modelled)")

        def need(field: str) -> int:
            value = getattr(config, field, None)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}: field {field!r} is {value!r}; expected a positive int "
                                 "(the accounting needs a dense Llama-like config)")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        model_type = getattr(config, "model_type", "")
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            hidden=hidden, layers=need("num_hidden_layers"), heads=heads, kv_heads=int(kv_heads),
            head_dim=int(head_dim), intermediate=need("intermediate_size"), vocab=need("vocab_size"),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 hard-codes bias on q/k/v (not o); Llama reads `attention_bias` for all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights that take part in a matmul, per layer: Wq, Wk, Wv, Wo and the 3 SwiGLU matrices."""
        h = self.hidden
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * self.intermediate

    @property
    def layer_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.hidden * self.o_bias
        bias += (2 * self.intermediate + self.hidden) * self.mlp_bias
        return self.layer_matmul_params + bias + 2 * self.hidden  # + 2 RMSNorm weights

    @property
    def params(self) -> int:
        """Total parameter count, equal to `sum(p.numel() for p in model.parameters())`."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that multiply every token: all layers' matrices + the LM head."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden


def _shape(config: Any) -> ModelShape:
    return ModelShape.from_config(config)


def _dtype(config: Any, dtype: torch.dtype | str | None) -> str:
    if dtype is not None:
        return dtype_name(dtype)
    configured = getattr(config, "dtype", None)
    return dtype_name(configured) if configured not in (None, "auto") else "fp32"


def _check(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"costs: {name}={value!r}; expected a non-negative int")


def _check_samples(batch: int, samples: int) -> None:
    if not isinstance(samples, int) or samples < 1 or batch % samples:
        raise ValueError(f"costs: samples={samples!r}; expected a positive int dividing batch={batch}")


def _head_rows(logits: Logits, batch: int, tokens: int) -> tuple[int, int]:
    """(rows through the head, head output width factor): 'all' → B·T rows, 'last' → B rows."""
    if logits == "all":
        return batch * tokens, 1
    if logits == "last":
        return batch, 1
    if logits == "scalar":
        return batch * tokens, 0
    raise ValueError(f"costs: logits={logits!r}; expected 'all', 'last' or 'scalar'")


@dataclass(frozen=True)
class _Traffic:
    """Element counts of one forward: FLOPs, weight elements read, activation elements moved, KV written."""

    flops: float
    weights: float
    activations: float
    kv_written: float

    def cost(self, nbytes: int) -> Cost:
        return Cost(self.flops, nbytes * (self.weights + self.activations + self.kv_written))


def _forward(s: ModelShape, batch: int, tokens: int, context: int, logits: Logits, kv_write: bool,
             shared: int = 0, samples: int = 1) -> _Traffic:
    """One forward over `tokens` new positions per sequence attending to `context` keys each; the first
    `shared` of them are read once for every `samples` sequences (a prompt's samples sharing its cache).

    FLOPs: 2·(B·T)·(matmul params of all layers) + 4·B·T·S·(H·Q)·L (scores + P·V) + the head.
    """
    n = batch * tokens
    head_rows, vocab_out = _head_rows(logits, batch, tokens)
    head_out = s.vocab if vocab_out else 1
    flops = 2.0 * n * s.layers * s.layer_matmul_params          # projections + MLP
    flops += 4.0 * n * context * s.q_dim * s.layers              # Q·Kᵀ and P·V, dense T×S
    flops += 2.0 * head_rows * s.hidden * head_out               # LM head (or scalar head)

    # weights: every layer, the final norm, the head matrix, and the embedding rows gathered
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    weights = s.layers * s.layer_params + h + h * head_out + n * h
    # activations: each matmul reads its input and writes its output once; attention reads Q and
    # the K,V of the whole context and writes O (fused: the T×S scores never reach memory)
    per_token_layer = (
        h + (q + 2 * kv)          # q,k,v projections: read x once, write q,k,v
        + q + h                   # o_proj: read attention output, write h
        + h + 2 * i               # gate, up: read x once, write 2·I
        + i + h                   # down: read the SwiGLU product, write h
        + q + q                   # attention: read Q, write O
    )
    act = n * s.layers * per_token_layer
    act += (batch * (context - shared) + batch // samples * shared) * 2 * kv * s.layers  # attention reads K,V
    act += head_rows * (h + head_out)                            # head: read h, write logits
    kv_written = n * 2 * kv * s.layers if kv_write else 0        # new K,V appended to the cache
    return _Traffic(flops, float(weights), float(act), float(kv_written))


def forward(config: Any, *, batch: int, seq_len: int, logits: Logits = "all",
            dtype: torch.dtype | str | None = None) -> Cost:
    """A forward-only pass over B × T tokens without a cache (reference log-probs, scoring, eval).

    `logits="scalar"` for a reward/value model whose head maps hidden → 1.
    """
    _check(batch=batch, seq_len=seq_len)
    nbytes = bytes_per_element(_dtype(config, dtype))
    return _forward(_shape(config), batch, seq_len, seq_len, logits, kv_write=False).cost(nbytes)


def prefill(config: Any, *, batch: int, prompt_len: int, logits: Logits = "last",
            dtype: torch.dtype | str | None = None) -> Cost:
    """The prompt's forward at the start of generation: fills the KV cache, logits for the last position."""
    _check(batch=batch, prompt_len=prompt_len)
    nbytes = bytes_per_element(_dtype(config, dtype))
    return _forward(_shape(config), batch, prompt_len, prompt_len, logits, kv_write=True).cost(nbytes)


def decode_step(config: Any, *, batch: int, context: int, dtype: torch.dtype | str | None = None,
                shared: int = 0, samples: int = 1) -> Cost:
    """One decode step: B new tokens, each attending to `context` keys (the cache plus itself).

    Bytes are dominated by the weights (read once per step, whatever the batch) and the KV cache
    (2·L·kv_heads·head_dim·context·B elements read, 2·L·kv_heads·head_dim·B written). With `samples` > 1
    the B rows are B / samples prompts' samples and the first `shared` keys of each row (its prompt's)
    are read once per prompt.
    """
    _check(batch=batch, context=context, shared=shared)
    _check_samples(batch, samples)
    nbytes = bytes_per_element(_dtype(config, dtype))
    return _forward(_shape(config), batch, 1, context, "all", kv_write=True, shared=shared, samples=samples).cost(nbytes)


def decode(config: Any, *, batch: int, prompt_len: int, new_tokens: int,
           dtype: torch.dtype | str | None = None, samples: int = 1, shared_reads: bool = True) -> Cost:
    """Generating `new_tokens` per sequence: prefill + (new_tokens − 1) decode steps, summed exactly.

    Step j (1 ≤ j < N) attends to P + j keys. Every term of a step is affine in its context c,
    step(c) = step(0) + c·(step(1) − step(0)), so Σ_j step(P + j) = (N−1)·step(0) + C·Δ with
    C = Σ_{j=1}^{N−1} (P + j) = (N−1)·P + (N−1)·N/2.

    `samples`: the B sequences are B / samples prompts' samples, prompt-major — each prompt prefilled once,
    and (`shared_reads`) its keys and values read once per decode step for all its samples: the least any
    engine moves, and what the native engine's shared prompt cache does (`rollout/cpu/fused.py` departure
    12); `shared_reads=False` for an engine that reads a copy per sample.
    """
    _check(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    _check_samples(batch, samples)
    if new_tokens == 0:
        return Cost()
    s, nbytes = _shape(config), bytes_per_element(_dtype(config, dtype))
    total = _forward(s, batch // samples, prompt_len, prompt_len, "last", kv_write=True).cost(nbytes)
    steps = new_tokens - 1
    if steps:
        shared = prompt_len if samples > 1 and shared_reads else 0
        f0 = _forward(s, batch, 1, 0, "all", kv_write=True, shared=shared, samples=samples).cost(nbytes)
        f1 = _forward(s, batch, 1, 1, "all", kv_write=True, shared=shared, samples=samples).cost(nbytes)
        context_sum = steps * prompt_len + steps * (steps + 1) / 2
        total = total + f0 * steps + Cost(f1.flops - f0.flops, f1.bytes - f0.bytes) * context_sum
    return total


def _generate_naive(config: Any, *, batch: int, prompt_len: int, new_tokens: int,
                    dtype: torch.dtype | str | None = None, samples: int = 1, shared_reads: bool = True) -> Cost:
    """The loop `decode` sums in closed form (kept to prove the closed form right)."""
    if new_tokens == 0:
        return Cost()
    total = prefill(config, batch=batch // samples, prompt_len=prompt_len, dtype=dtype)
    for j in range(1, new_tokens):
        total = total + decode_step(config, batch=batch, context=prompt_len + j, dtype=dtype,
                                    shared=prompt_len if samples > 1 and shared_reads else 0, samples=samples)
    return total


def adamw(config: Any, *, dtype: torch.dtype | str | None = None, trainable_params: int | None = None) -> Cost:
    """AdamW's update: ~12 elementwise FLOPs per parameter (not matmuls); bytes: read param, grad,
    m, v and write param, m, v — 7 × params × bytes per element."""
    n = trainable_params if trainable_params is not None else _shape(config).params
    return Cost(12.0 * n, 7.0 * n * bytes_per_element(_dtype(config, dtype)))


def train_step(config: Any, *, batch: int, seq_len: int, dtype: torch.dtype | str | None = None,
               logits: Logits = "all", recompute: bool = False, optimizer: bool = True) -> Cost:
    """Forward + backward over B × T tokens (+ the AdamW step's memory traffic if `optimizer`).

    FLOPs: 3 × the forward's matmul FLOPs (4 × with activation recomputation) — PaLM appendix B.
    AdamW's ~12 elementwise FLOPs per parameter are left out (not matmuls; < 0.1% of a step).
    Bytes: the forward's; the backward reads the weights again, writes a gradient for every
    parameter and moves ≈ 2 × the forward's activations (read saved input + output gradient, write
    input gradient); AdamW moves 7 × params.
    """
    _check(batch=batch, seq_len=seq_len)
    s, name = _shape(config), _dtype(config, dtype)
    nbytes = bytes_per_element(name)
    fwd = _forward(s, batch, seq_len, seq_len, logits, kv_write=False)
    passes = 2 if recompute else 1
    flops = (passes + 2) * fwd.flops
    elements = passes * (fwd.weights + fwd.activations) + fwd.weights + s.params + 2 * fwd.activations
    total = Cost(flops, nbytes * elements)
    if optimizer:
        total = total + Cost(0.0, adamw(s, dtype=name).bytes)
    return total


def palm_train_flops(config: Any, *, batch: int, seq_len: int) -> float:
    """PaLM appendix B: (6N + 12·L·H·Q·T) per token × B·T tokens, N = matmul parameters incl. the head."""
    s = _shape(config)
    return batch * seq_len * (6.0 * s.matmul_params + 12.0 * s.layers * s.q_dim * seq_len)
