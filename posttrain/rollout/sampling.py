"""Sampling parameters and the sampler: logits in, one token per row with its two log-probs out.

The filters are the standard ones, applied in the order `transformers` applies its warpers:
temperature (Ackley et al. 1985), top-k (Fan et al. 2018, "Hierarchical Neural Story Generation"),
nucleus / top-p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", eq. 2: the
smallest set whose probability mass reaches p), min-p (Nguyen et al. 2024, "Turning Up the Heat:
Min-p Sampling": drop tokens with p < min_p · p_max). Each filter sees the distribution the previous
one left.

Departures (numbered):
1. No logits-processor objects: `process_logits` is one pure function over fp32 logits.
2. Sampling is by inversion (the inverse-transform method): one uniform U per row, and the token is
   the first i whose cumulative probability exceeds U times their total — token i is drawn with
   probability q_i up to two roundings: of the cumulative sums to float32 (a CPU's `cumsum`
   accumulates in float64, other devices sum in float64; ≤ 2⁻²⁴ of the total either way, whatever the
   vocabulary) and of U to its 2⁻²⁴ grid. A token whose probability is 0 — filtered, −inf — is never
   drawn. One random number per row per step, where the Gumbel-max trick (argmax_i log q_i + G_i)
   needs a whole vocabulary of noise: at a 152k vocabulary and 16 rows a Gumbel-max step took 17 ms on
   a 2-core CPU, an inversion step 4.6 ms, and `torch.multinomial` (what `transformers` calls) 64 ms
   (`benchmarks/sampling.py`). The engine draws U for *all* rows every step (`draw_uniforms`, one call
   per `generate`), so a row's tokens do not depend on which other rows are still running (batch
   compaction cannot change a sample). With `shard=(first, total)` it draws them for the whole
   `total`-row batch and keeps its own rows' columns, so rows split over several calls (data-parallel
   ranks) sample what one call over all of them would.
3. Two log-probs per sampled token: `logprobs` under the distribution actually sampled from
   (after temperature and filters; 0 for greedy, a point mass) and `policy_logprobs` under the raw
   model at temperature 1 — the log π_θ(y) that a teacher-forced forward of the same model reproduces
   and that the PPO/GRPO importance ratio exp(log π_θ − log π_old) must use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature=0` is greedy (the filters are then ignored)."""

    n: int = 1                      # samples per prompt (GRPO's group size)
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0              # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0                  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0              # drop tokens with p < min_p · p_max; 0 = off
    max_new_tokens: int = 64        # completion budget per sequence (EOS included)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings; kept in the text, which ends there
    seed: int | None = None         # None: draw from torch's global generator
    # (first, total): this call's rows are rows first … of a `total`-row batch drawn with `seed` — it
    # samples them with the random numbers that batch would have used (a data-parallel rank's share of
    # a global rollout samples what one process samples; native engine only). None: a batch of its own
    shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        checks = [
            ("n", self.n, isinstance(self.n, int) and self.n >= 1, "an int ≥ 1"),
            ("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0, "≥ 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an int ≥ 0"),
            ("min_p", self.min_p, 0 <= self.min_p < 1, "in [0, 1)"),
            ("max_new_tokens", self.max_new_tokens,
             isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "an int ≥ 1"),
            ("stop", self.stop, all(isinstance(s, str) and s for s in stop), "non-empty strings"),
            ("seed", self.seed, self.seed is None or isinstance(self.seed, int), "an int or None"),
            ("shard", self.shard, self.shard is None or (len(self.shard) == 2 and 0 <= self.shard[0] < self.shard[1]),
             "None or (first, total) with 0 ≤ first < total"),
        ]
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r}: expected {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def is_identity(self) -> bool:
        """True when the sampling distribution is the raw model's (T = 1, no filter)."""
        return self.temperature == 1 and self.top_k == 0 and self.top_p == 1 and self.min_p == 0


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, top-p, min-p. Shape: (rows, vocab) fp32 in and out; excluded → −inf.

    At least one token always survives (the most likely one), as in `transformers`.
    """
    z = logits / params.temperature if params.temperature != 1 else logits
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]          # (rows, 1)
        z = z.masked_fill(z < kth, float("-inf"))                            # ties with the k-th stay in
    if params.top_p < 1:
        sorted_z, order = torch.sort(z, dim=-1)                               # ascending
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p                                 # the low tail holding ≤ 1−p
        drop_sorted[..., -1] = False                                          # keep the top token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    if params.min_p > 0:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return z


def draw_uniforms(steps: int, rows: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """U ~ Uniform[0, 1) for each row of each step, one draw for the whole decode. Shape: (steps, rows) fp32."""
    return torch.rand(steps, rows, dtype=torch.float32, device=device, generator=generator)


def shard_uniforms(steps: int, rows: int, generator: torch.Generator | None, device: torch.device,
                   shard: tuple[int, int] | None) -> Tensor:
    """`draw_uniforms` for `rows` rows — or, with `shard=(first, total)`, the columns first … first + rows
    of the draw for all `total` rows (what those rows get when one call samples the whole batch).
    Shape: (steps, rows) fp32."""
    if shard is None:
        return draw_uniforms(steps, rows, generator, device)
    first, total = shard
    if first + rows > total:
        raise ValueError(f"SamplingParams.shard={shard}: rows {first} … {first + rows - 1} are not in a batch of {total}")
    return draw_uniforms(steps, total, generator, device)[:, first : first + rows].contiguous()


SMALL_VOCAB = 4096  # vocabularies up to which the draw takes the fewest ops; above, the fewest passes


def _cumulative(z: Tensor) -> tuple[Tensor, Tensor | None]:
    """Cumulative sums over the vocabulary of softmax(z) up to a per-row factor (departure 2): float32 on
    a CPU (its `cumsum` accumulates in float64), float64 elsewhere; and the row max they are relative to.

    A small vocabulary (≤ `SMALL_VOCAB`) takes `softmax`, one fused kernel (max None); a larger one
    exp(z − max), whose total is then the softmax denominator, so the drawn token's log-prob needs no
    log-softmax of whole rows (fewer passes over long rows; `benchmarks/sampling.py` times both forms).
    The form depends on the vocabulary only, never on the row count, so compacting a batch cannot change
    a draw. Shapes: z (rows, vocab) fp32 → (rows, vocab), (rows, 1) or None."""
    if z.shape[-1] <= SMALL_VOCAB:
        top, e = None, z.softmax(-1)
    else:
        top = z.amax(-1, keepdim=True)
        e = torch.sub(z, top).exp_()
    return (e.cumsum_(-1) if e.device.type == "cpu" else e.cumsum(-1, dtype=torch.float64)), top


def _targets(cdf: Tensor, u: Tensor) -> Tensor:
    """U · total, kept strictly below the total (so that some token's cumulative sum exceeds it, and the
    first that does has probability > 0). Shapes: cdf (rows, vocab), u (rows,) → (rows, 1)."""
    total = cdf[:, -1:]
    return torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))


def _picked_logprob(z: Tensor, picked: Tensor, cdf: Tensor, top: Tensor | None, out: Tensor) -> None:
    """out ← log softmax(z) at the drawn tokens: from the log-softmax (small vocabulary) or as z − max − log total."""
    if top is None:
        torch.gather(z.log_softmax(-1), 1, picked, out=out[:, None])
    else:
        torch.sub(z.gather(1, picked), cdf[:, -1:].log().to(z.dtype).add_(top), out=out[:, None])


def sample_into(logits: Tensor, params: SamplingParams, u: Tensor, tokens: Tensor, logprobs: Tensor,
                policy_logprobs: Tensor) -> None:
    """`sample` for temperature > 0, written into the given (rows,) buffers.

    The same draw as `sample(logits, params, u)` (tested), with a binary search instead of a count and no
    allocation of the outputs: the decode loop's hot path. Shapes: logits (rows, vocab) fp32; u (rows,)
    uniforms in [0, 1); tokens (rows,) long; logprobs/policy_logprobs (rows,) fp32.
    """
    if params.greedy:
        raise ValueError("sample_into: greedy draws nothing; use sample")
    logits = logits.float()
    z = logits if params.is_identity else process_logits(logits, params)
    cdf, top = _cumulative(z)
    torch.searchsorted(cdf, _targets(cdf, u), right=True, out=tokens[:, None])  # first cdf > U · total
    picked = tokens[:, None]
    _picked_logprob(z, picked, cdf, top, logprobs)
    if z is logits:
        policy_logprobs.copy_(logprobs)
    else:
        torch.gather(logits.log_softmax(-1), 1, picked, out=policy_logprobs[:, None])


def sample(logits: Tensor, params: SamplingParams, u: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row. Shapes: logits (rows, vocab) → tokens (rows,) long, two (rows,) fp32 log-probs.

    Returns (tokens, logprobs under the sampling distribution, policy_logprobs under the raw model).
    `u` is one uniform in [0, 1) per row (`draw_uniforms`); ignored (may be None) when greedy. The token
    is the number of cumulative sums at or below U · total (the naive form of `sample_into`'s search).
    """
    logits = logits.float()
    policy = logits.log_softmax(-1)                                          # (rows, vocab)
    if params.greedy:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros_like(tokens, dtype=torch.float32), policy.gather(-1, tokens[:, None])[:, 0]
    if u is None:
        raise ValueError("sample: u is required when temperature > 0 (see draw_uniforms)")
    z = logits if params.is_identity else process_logits(logits, params)
    logq = z.log_softmax(-1)
    cdf, _ = _cumulative(z)
    tokens = (cdf <= _targets(cdf, u)).sum(-1)                              # inversion
    picked = tokens[:, None]
    return tokens, logq.gather(-1, picked)[:, 0], policy.gather(-1, picked)[:, 0]
