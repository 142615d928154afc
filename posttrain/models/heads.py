"""Scalar heads on a causal LM's backbone: the reward model and PPO's critic (value model).

Both are a Hugging Face `*ForSequenceClassification` model with one label — the policy's backbone
(`model.model` for Llama/Qwen2) plus `score`, a bias-free Linear(hidden → 1) — as InstructGPT
(Ouyang et al. 2022, §3.5) builds its reward model: "starting from the SFT model with the final
unembedding layer removed", a projection to a scalar. The checkpoint is therefore a plain HF folder
that `AutoModelForSequenceClassification.from_pretrained` (and TRL) load back.

Departures:
1. We do not use the HF forward's pooling (rightmost token that is not the pad id); `token_scores`
   returns the score at every position and `last_token_scores` picks each row's last attended
   position from the attention mask, so left-padded prompts + right-padded completions (a rollout
   batch) and a pad id equal to EOS both work. On right-padded batches with a distinct pad id the two
   agree (tests/test_pref_heads.py).
2. The score head of a new reward model is zero-initialized (every reward starts at 0; the backbone
   gets gradient from the second step), so a run does not depend on the RNG draw of the head.
3. Reward normalization (InstructGPT appendix C.2: "the reward model is normalized so that the
   labeler demonstrations achieve a mean score of 0") uses the mean *and* standard deviation of the
   RM's scores on samples of the starting policy, stored beside the weights in `reward_norm.json`, so
   a KL coefficient means the same thing whatever scale a reward model learned.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification, PreTrainedModel
from transformers.utils import logging as hf_logging

from posttrain.models import lora
from posttrain.models.loading import load_model

REWARD_NORM_FILE = "reward_norm.json"


def load_scalar_model(path: str | Path, *, device: str | torch.device = "cpu", zero_head: bool = False) -> PreTrainedModel:
    """A one-label sequence-classification model from a local folder.

    From a causal-LM checkpoint the backbone is reused and the head is new (zeroed if `zero_head`);
    from a reward-model checkpoint everything loads as saved.
    """
    path = Path(path)
    if lora.adapter_base(path) is not None:
        return _load_scalar_adapter(path, device=device, zero_head=zero_head)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a Hugging Face model folder (no config.json)")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the 'score.weight MISSING' load report is expected from a causal LM
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    if not hasattr(model, "score") or not hasattr(model, model.base_model_prefix):
        raise ValueError(f"{path}: {type(model).__name__} has no `score` head over `{model.base_model_prefix}`; "
                         "expected a decoder-only model (Llama, Qwen2, Mistral, …)")
    if zero_head:
        with torch.no_grad():
            model.score.weight.zero_()
    return model.to(device)


def _load_scalar_adapter(path: Path, *, device: str | torch.device, zero_head: bool) -> PreTrainedModel:
    """A LoRA checkpoint as a scalar model: a reward-model adapter (its head saved beside it, PEFT
    `modules_to_save`) merged onto the scalar model of its base; or a causal-LM adapter chain, merged,
    whose backbone gets a new head (zeroed if `zero_head`)."""
    raw = json.loads((path / lora.ADAPTER_CONFIG).read_text())
    if "score" in (raw.get("modules_to_save") or []):
        base = load_scalar_model(lora.adapter_base(path), device="cpu", zero_head=True)
        return lora.merge_adapter(base, path).to(device)
    causal = load_model(path)  # the chain merged
    model = AutoModelForSequenceClassification.from_config(causal.config, num_labels=1)
    getattr(model, model.base_model_prefix).load_state_dict(getattr(causal, causal.base_model_prefix).state_dict())
    if zero_head:
        with torch.no_grad():
            model.score.weight.zero_()
    return model.to(device)


def token_scores(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor,
                 position_ids: Tensor | None = None) -> Tensor:
    """The scalar head at every position. Shape: (B, T) ids and mask → (B, T) fp32 scores."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    return model.score(hidden).squeeze(-1).float()  # (B, T)


def last_positions(attention_mask: Tensor) -> Tensor:
    """Index of each row's last attended position. Shape: (B, T) → (B,) long. A row with no token is an error."""
    keep = attention_mask.bool()
    if not keep.any(-1).all():  # device sync; an empty row has no last token to score
        rows = (~keep.any(-1)).nonzero().flatten().tolist()
        raise ValueError(f"last_positions: rows {rows} have no attended token")
    positions = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    return torch.where(keep, positions, -1).amax(-1)


def last_token_scores(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor,
                      position_ids: Tensor | None = None) -> Tensor:
    """The reward: the head's output at each row's last attended token. Shape: (B, T) → (B,) fp32."""
    scores = token_scores(model, input_ids, attention_mask, position_ids)  # (B, T)
    return scores.gather(1, last_positions(attention_mask)[:, None]).squeeze(1)


@dataclass(frozen=True)
class RewardNormalization:
    """score ↦ (score − mean) / std, with mean and std measured on `n` samples of `policy`."""

    mean: float
    std: float
    n: int
    policy: str  # the checkpoint whose samples were scored (the policy PPO starts from)

    def apply(self, scores: Tensor) -> Tensor:
        return (scores - self.mean) / self.std

    def save(self, folder: str | Path) -> None:
        (Path(folder) / REWARD_NORM_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, folder: str | Path) -> RewardNormalization:
        path = Path(folder) / REWARD_NORM_FILE
        if not path.is_file():
            raise ValueError(f"{folder}: no {REWARD_NORM_FILE}; expected a reward-model checkpoint written by "
                             "the reward_model stage (or add the file: {\"mean\", \"std\", \"n\", \"policy\"})")
        raw = json.loads(path.read_text())
        norm = cls(mean=float(raw["mean"]), std=float(raw["std"]), n=int(raw["n"]), policy=str(raw["policy"]))
        if not norm.std > 0:
            raise ValueError(f"{path}: std must be > 0, got {norm.std}")
        return norm


def is_reward_model(folder: str | Path) -> bool:
    return (Path(folder) / REWARD_NORM_FILE).is_file()
