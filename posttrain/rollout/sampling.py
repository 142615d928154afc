"""Sampling parameters and the sampler: logits in, one token per row with its two log-probs out.

The filters are the standard ones, applied in the order `transformers` applies its warpers:
temperature (Ackley et al. 1985), top-k (Fan et al. 2018, "Hierarchical Neural Story Generation"),
nucleus / top-p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", eq. 2: the
smallest set whose probability mass reaches p), min-p (Nguyen et al. 2024, "Turning Up the Heat:
Min-p Sampling": drop tokens with p < min_p · p_max). Each filter sees the distribution the previous
one left.

Departures (numbered):
1. No logits-processor objects: `process_logits` is one pure function over fp32 logits.
2. Sampling is the Gumbel-max trick — argmax_i (log q_i + G_i), G_i = −log(−log U_i) i.i.d. standard
   Gumbel — which draws token i with probability exactly q_i (Gumbel 1954; Maddison et al. 2014,
   "A* Sampling", §2). Its noise is a plain (rows, vocab) tensor, so the engine can draw it for *all*
   rows every step: a row's tokens then do not depend on which other rows are still running (batch
   compaction cannot change a sample). (Uniforms + two logs: `exponential_` is ~6× slower on CPU.)
   `GumbelNoise` draws that noise for several steps in one call (bounded memory), which on a small
   model saves five tensor ops per step; the distribution of every draw is unchanged.
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


def draw_noise(rows: int, vocab: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Standard Gumbel noise. Shape: (rows, vocab), fp32. U ∈ [0, 1) gives G ∈ [−∞, 16.6]: never +∞,
    so log q = −∞ (a filtered token) plus G is −∞, never NaN."""
    u = torch.rand(rows, vocab, dtype=torch.float32, device=device, generator=generator)
    return u.log_().neg_().log_().neg_()


class GumbelNoise:
    """`draw_noise(rows, vocab)` for each of `steps` steps, drawn `chunk` steps per call.

    chunk = as many steps as fit in `max_elements` floats (16 MB by default), at least 1: a large
    vocabulary falls back to one draw per step. Each `next()` is one step's (rows, vocab) standard Gumbel
    noise; the draws are i.i.d. whatever the chunking.
    """

    def __init__(self, rows: int, vocab: int, steps: int, generator: torch.Generator | None,
                 device: torch.device, max_elements: int = 1 << 22):
        self.rows, self.vocab, self.generator, self.device = rows, vocab, generator, device
        self.left = steps
        self.chunk = max(1, min(steps, max_elements // max(1, rows * vocab)))
        self._buf: Tensor | None = None
        self._i = 0

    def next(self) -> Tensor:
        """Shape: (rows, vocab) fp32. The caller may overwrite it (it is never handed out twice)."""
        if self._buf is None or self._i == self._buf.shape[0]:
            if self.left <= 0:
                raise RuntimeError("GumbelNoise: all steps drawn")
            k = min(self.chunk, self.left)
            self._buf = draw_noise(k * self.rows, self.vocab, self.generator, self.device).view(k, self.rows, self.vocab)
            self._i, self.left = 0, self.left - k
        self._i += 1
        return self._buf[self._i - 1]


def sample_into(logits: Tensor, params: SamplingParams, noise: Tensor, tokens: Tensor, logprobs: Tensor,
                policy_logprobs: Tensor) -> None:
    """`sample` for temperature > 0, written into the given (rows,) buffers; `noise` is overwritten.

    The same draw as `sample(logits, params, noise)` (tested), with fewer ops and no allocation of
    the outputs: the decode loop's hot path. Shapes: logits/noise (rows, vocab) fp32; tokens (rows,)
    long; logprobs/policy_logprobs (rows,) fp32.
    """
    if params.greedy:
        raise ValueError("sample_into: greedy has no noise; use sample")
    policy = logits.float().log_softmax(-1)                                  # (rows, vocab)
    logq = policy if params.is_identity else process_logits(logits.float(), params).log_softmax(-1)
    torch.argmax(noise.add_(logq), -1, out=tokens)                           # Gumbel-max
    picked = tokens[:, None]
    torch.gather(logq, 1, picked, out=logprobs[:, None])
    if logq is policy:
        policy_logprobs.copy_(logprobs)
    else:
        torch.gather(policy, 1, picked, out=policy_logprobs[:, None])


def sample(logits: Tensor, params: SamplingParams, noise: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row. Shapes: logits (rows, vocab) → tokens (rows,) long, two (rows,) fp32 log-probs.

    Returns (tokens, logprobs under the sampling distribution, policy_logprobs under the raw model).
    `noise` is `draw_noise(rows, vocab, ...)`; ignored (may be None) when greedy.
    """
    logits = logits.float()
    policy = logits.log_softmax(-1)                                          # (rows, vocab)
    if params.greedy:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros_like(tokens, dtype=torch.float32), policy.gather(-1, tokens[:, None])[:, 0]
    if noise is None:
        raise ValueError("sample: noise is required when temperature > 0 (see draw_noise)")
    logq = policy if params.is_identity else process_logits(logits, params).log_softmax(-1)
    tokens = (logq + noise).argmax(-1)                                       # Gumbel-max
    picked = tokens[:, None]
    return tokens, logq.gather(-1, picked)[:, 0], policy.gather(-1, picked)[:, 0]
