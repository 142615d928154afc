"""Token-side text handling shared by every backend: prompts in (left-padded), stop strings, decoding.

Conventions (the same for every backend):
- A prompt given as a string is encoded with the tokenizer's defaults (`tokenizer(text)`, so a BOS is
  added where the tokenizer adds one); a prompt given as token ids is used as is. Chat-templated
  prompts should be passed as ids (`apply_chat_template(..., tokenize=True)`) to avoid a second BOS.
- A stop string ends a sequence at the token that completes it. The token ids keep that whole token;
  the text is cut right after the stop string (the stop string stays in the text). So the text can be
  shorter than `decode(ids)` when the last token runs past the stop string.
- Texts are decoded with `skip_special_tokens=True`: the EOS token is in the ids (the policy must
  learn to emit it) but not in the text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase


def encode_prompts(prompts: Sequence[Sequence[int]] | Sequence[str],
                   tokenizer: PreTrainedTokenizerBase | None) -> list[list[int]]:
    """Token ids of each prompt; raises on an empty batch, an empty prompt or mixed types."""
    if isinstance(prompts, (str, Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: expected a list of strings or a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts: empty batch; expected at least one prompt")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("prompts are strings but the engine has no tokenizer; pass token ids or a tokenizer")
        ids = [list(tokenizer(p)["input_ids"]) for p in prompts]
    elif any(isinstance(p, str) for p in prompts):
        raise TypeError("prompts: mixed strings and token-id lists; pass one kind")
    else:
        ids = [[int(t) for t in p] for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompts[{i}] is empty (0 tokens); every prompt needs at least one token")
    return ids


def left_pad(ids: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Shape: (B, P) long ids, left-padded with `pad_id`, and the (B, P) bool mask of real tokens."""
    width = max(len(p) for p in ids)
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.bool)
    for i, p in enumerate(ids):
        out[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = True
    return out.to(device), mask.to(device)


def positions_from_mask(mask: Tensor) -> Tensor:
    """Position ids of a left-padded batch: 0.. on real tokens, 1 on pads (as `generate` does). (B, P)."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(~mask.bool(), 1)


class StopStrings:
    """Finds, step by step, the rows whose newest token completes one of the stop strings.

    A stop string of b UTF-8 bytes spans at most b tokens (each token holds ≥ 1 byte), and we check
    after every token, so an occurrence not seen before must end in the newest token and lie within
    the last b + 1 tokens. Decoding only that window keeps the check O(rows) per step instead of
    re-decoding whole completions; the extra token absorbs a multi-byte character cut at the window's
    left edge (it decodes to U+FFFD, which no stop string contains).
    """

    def __init__(self, stops: Sequence[str], tokenizer: PreTrainedTokenizerBase | None):
        self.stops = tuple(stops)
        if self.stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode completions; the engine has none")
        self.tokenizer = tokenizer
        self.window = max((len(s.encode()) for s in self.stops), default=0) + 1

    def hits(self, completions: list[list[int]]) -> list[bool]:
        """For each row's completion so far, whether its newest token completed a stop string."""
        if not self.stops:
            return [False] * len(completions)
        tails = self.tokenizer.batch_decode([c[-self.window:] for c in completions], skip_special_tokens=True)
        return [any(s in t for s in self.stops) for t in tails]

    def cut(self, text: str) -> str:
        """`text` cut right after the earliest-ending stop string in it (unchanged if none)."""
        ends = [i + len(s) for s in self.stops if (i := text.find(s)) >= 0]
        return text[: min(ends)] if ends else text
