"""`Rollout`: what every backend returns — prompts, completions, per-token log-probs, masks, reasons.

Row layout: B prompts × n samples = R rows, prompt-major (rows i·n … i·n + n − 1 come from prompt i;
`prompt_index` says so explicitly). Prompts are left-padded, completions right-padded, so
`cat([prompt_ids, completion_ids], 1)` is a ready-to-forward batch (`sequence_ids`, `sequence_mask`,
`position_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from posttrain.rollout.text import StopStrings, positions_from_mask


class FinishReason(str, Enum):  # str-valued (StrEnum is 3.11+; the project supports 3.10)
    STOP = "stop"      # EOS emitted or a stop string completed
    LENGTH = "length"  # max_new_tokens reached without a stop


@dataclass
class Rollout:
    """A batch of sampled completions. R = B·n rows; P = longest prompt; N = longest completion."""

    prompt_ids: Tensor          # (R, P) long, left-padded with the pad id
    prompt_mask: Tensor         # (R, P) bool, True on real prompt tokens
    completion_ids: Tensor      # (R, N) long, right-padded with the pad id; includes the EOS token
    completion_mask: Tensor     # (R, N) bool, True on generated tokens (EOS included)
    logprobs: Tensor            # (R, N) fp32: log q(y_t), q = the sampling distribution (0 for greedy; 0 on pads)
    policy_logprobs: Tensor     # (R, N) fp32: log π(y_t) under the raw model at T = 1 (0 on pads) — use for PPO/GRPO
    finish_reason: list[str]    # (R,) "stop" | "length"
    prompt_index: Tensor        # (R,) long: the prompt each row came from
    texts: list[str]            # (R,) decoded completions (special tokens skipped, cut after a stop string)

    def __post_init__(self) -> None:
        r = self.prompt_ids.shape[0]
        shapes = {"prompt_mask": (self.prompt_mask, self.prompt_ids.shape),
                  "completion_mask": (self.completion_mask, self.completion_ids.shape),
                  "logprobs": (self.logprobs, self.completion_ids.shape),
                  "policy_logprobs": (self.policy_logprobs, self.completion_ids.shape),
                  "prompt_index": (self.prompt_index, (r,))}
        for name, (t, want) in shapes.items():
            if tuple(t.shape) != tuple(want):
                raise ValueError(f"Rollout.{name} has shape {tuple(t.shape)}, expected {tuple(want)}")
        if self.completion_ids.shape[0] != r or len(self.finish_reason) != r or len(self.texts) != r:
            raise ValueError(f"Rollout: rows disagree: prompts {r}, completions {self.completion_ids.shape[0]}, "
                             f"finish_reason {len(self.finish_reason)}, texts {len(self.texts)}")

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def completion_lengths(self) -> Tensor:  # (R,) long
        return self.completion_mask.sum(-1)

    @property
    def sequence_ids(self) -> Tensor:  # (R, P + N)
        return torch.cat([self.prompt_ids, self.completion_ids], 1)

    @property
    def sequence_mask(self) -> Tensor:  # (R, P + N) bool
        return torch.cat([self.prompt_mask, self.completion_mask], 1)

    @property
    def position_ids(self) -> Tensor:  # (R, P + N): what the engine used; pass it to a teacher-forced forward
        return positions_from_mask(self.sequence_mask)


def assemble(*, prompt_ids: Tensor, prompt_mask: Tensor, n: int, tokens: Tensor, logprobs: Tensor,
             policy_logprobs: Tensor, lengths: Tensor, stopped: Tensor, pad_id: int,
             tokenizer: PreTrainedTokenizerBase | None, stops: StopStrings) -> Rollout:
    """Build a `Rollout` from a backend's raw buffers.

    Shapes: prompt_ids/prompt_mask (B, P) (one row per prompt, expanded here to R = B·n);
    tokens/logprobs/policy_logprobs (R, ≥ max length), anything past a row's length is ignored;
    lengths (R,) long; stopped (R,) bool (EOS or stop string, else the length budget ended the row).
    """
    rows = prompt_ids.shape[0] * n
    width = int(lengths.max()) if rows else 0
    cols = torch.arange(width, device=tokens.device)
    mask = cols[None, :] < lengths[:, None]                                   # (R, N)
    ids = tokens[:, :width].masked_fill(~mask, pad_id)
    lp = logprobs[:, :width].float().masked_fill(~mask, 0.0)
    plp = policy_logprobs[:, :width].float().masked_fill(~mask, 0.0)
    lengths_list = lengths.tolist()
    ids_list = ids.tolist()
    if tokenizer is not None:
        texts = tokenizer.batch_decode([row[:k] for row, k in zip(ids_list, lengths_list)], skip_special_tokens=True)
    else:
        texts = [""] * rows
    stopped_list = stopped.tolist()
    texts = [stops.cut(t) if s else t for t, s in zip(texts, stopped_list)]
    reasons = [FinishReason.STOP.value if s else FinishReason.LENGTH.value for s in stopped_list]
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(n, 0),
        prompt_mask=prompt_mask.repeat_interleave(n, 0),
        completion_ids=ids,
        completion_mask=mask,
        logprobs=lp,
        policy_logprobs=plp,
        finish_reason=reasons,
        prompt_index=torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(n),
        texts=texts,
    )
