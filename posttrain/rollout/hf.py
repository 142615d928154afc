"""The reference backend: `transformers` `generate`, wrapped to return a `Rollout`.

It exists to prove the native backend right (greedy token-for-token equality, same log-probs) and as
the fallback for models the native loop cannot run. Same conventions as every backend (see `text.py`).

Departures from a plain `generate` call (numbered):
1. Log-probs come from `output_logits` (raw, → `policy_logprobs`) and `output_scores` (after the
   warpers, → `logprobs`; 0 for greedy), so both fields mean what they mean for the native backend.
2. A row's length is recovered by replaying its tokens through the same stop rules (EOS, then stop
   strings), because `generate` pads finished rows with the pad id.
3. `seed` seeds torch's global generator inside `fork_rng`, so the caller's RNG state is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from posttrain.rollout.native import eos_ids_of, pad_id_of
from posttrain.rollout.output import Rollout, assemble
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.text import StopStrings, encode_prompts, left_pad
from posttrain.telemetry import costs


class HFEngine:
    """`model.generate` behind the rollout interface. Shares the module (no weight copy)."""

    name = "hf"

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 eos_token_ids: Sequence[int] | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = list(eos_token_ids) if eos_token_ids is not None else eos_ids_of(model, tokenizer)
        self.pad_id = pad_id_of(model, tokenizer, self.eos_ids)

    def update_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> None:
        if isinstance(model_or_state_dict, dict):
            self.model.load_state_dict(model_or_state_dict)
        elif model_or_state_dict is not self.model:
            self.model.load_state_dict(model_or_state_dict.state_dict())

    def decode_cost(self, *, batch: int, prompt_len: int, new_tokens: int, samples: int = 1) -> costs.Cost:
        """FLOPs and bytes of one generation on this engine's model (`telemetry.costs.decode`). `samples` does
        not change it: `generate` repeats each prompt `num_return_sequences` times before its prefill."""
        return costs.decode(self.model.config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    def release_memory(self) -> int:
        """Nothing to free: `generate` runs the training module itself and its cache dies with the call."""
        return 0

    def sync_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> int:
        """`update_weights`; the bytes loaded (0 for the shared module: `generate` reads it directly)."""
        if isinstance(model_or_state_dict, dict):
            moved = sum(t.nbytes for t in model_or_state_dict.values())
        else:
            moved = 0 if model_or_state_dict is self.model else sum(
                t.nbytes for t in model_or_state_dict.state_dict().values())
        self.update_weights(model_or_state_dict)
        return moved

    def _kwargs(self, params: SamplingParams) -> dict:
        kw: dict = {"max_new_tokens": params.max_new_tokens, "num_return_sequences": params.n,
                    "eos_token_id": self.eos_ids, "pad_token_id": self.pad_id, "output_logits": True,
                    "output_scores": True, "return_dict_in_generate": True}
        if params.greedy:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:  # pass every knob explicitly: a checkpoint's generation_config may carry other defaults
            kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                      min_p=params.min_p or None)
        if params.stop:
            kw.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        return kw

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str], params: SamplingParams) -> Rollout:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"generate: params must be a SamplingParams, got {type(params).__name__}")
        if params.shard is not None:
            raise ValueError("the hf backend cannot sample a shard of a batch (SamplingParams.shard); use the native backend")
        ids = encode_prompts(prompts, self.tokenizer)
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad(ids, self.pad_id, device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(),
                                          **self._kwargs(params))
        finally:
            self.model.train(was_training)
        new = out.sequences[:, prompt_ids.shape[1]:]                              # (R, N')
        raw = torch.stack(out.logits, 1).float()                                  # (R, N', V)
        policy = raw.log_softmax(-1).gather(-1, new[..., None])[..., 0]
        if params.greedy:
            logprobs = torch.zeros_like(policy)
        else:
            logprobs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
        stops = StopStrings(params.stop, self.tokenizer)
        lengths, stopped = self._replay(new.tolist(), stops)
        return assemble(prompt_ids=prompt_ids, prompt_mask=prompt_mask, n=params.n, tokens=new, logprobs=logprobs,
                        policy_logprobs=policy, lengths=torch.tensor(lengths, device=device),
                        stopped=torch.tensor(stopped, dtype=torch.bool, device=device), pad_id=self.pad_id,
                        tokenizer=self.tokenizer, stops=stops)

    def _replay(self, rows: list[list[int]], stops: StopStrings) -> tuple[list[int], list[bool]]:
        eos = set(self.eos_ids)
        lengths, stopped = [], []
        for row in rows:
            length, hit = len(row), False
            for t, tok in enumerate(row):
                if tok in eos or (stops.stops and stops.hits([row[: t + 1]])[0]):
                    length, hit = t + 1, True
                    break
            lengths.append(length)
            stopped.append(hit)
        return lengths, stopped
