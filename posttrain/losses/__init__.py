"""posttrain.losses: every objective of the pipeline as a pure function.

Tensors and explicit scalars in, `(loss, stats)` out; stats are frozen records of detached 0-d
tensors (`stats.as_floats()` reads them with one device sync). Per-token objectives return (B, T)
losses, reduced once by an `Aggregation`. See docs/losses.md for formulas, references and conventions.
"""

from posttrain.losses._stats import Stats
from posttrain.losses.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
)
from posttrain.losses.aggregation import (
    AGGREGATIONS,
    Aggregation,
    AggregationFn,
    LossNormalizer,
    loss_normalizer,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)
from posttrain.losses.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    KLRewardStats,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty_rewards,
)
from posttrain.losses.logprobs import (
    entropy_from_logits,
    sequence_logprob_mean,
    sequence_logprob_sum,
    token_logprobs,
    token_logprobs_naive,
)
from posttrain.losses.policy import (
    PolicyStats,
    ValueStats,
    clipped_value_loss,
    entropy_bonus,
    ppo_clip_loss,
    value_loss,
)
from posttrain.losses.preference import (
    PREFERENCE_METHODS,
    KTOStats,
    ORPOStats,
    PreferenceLoss,
    PreferenceMethod,
    PreferenceStats,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
)
from posttrain.losses.reward import RankingPairs, RewardStats, bradley_terry_loss, rankings_to_pairs
from posttrain.losses.sft import SFTStats, sft_loss

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "PREFERENCE_METHODS",
    "AdaptiveKLController",
    "Aggregation",
    "AggregationFn",
    "FixedKLController",
    "KLEstimator",
    "KLRewardStats",
    "KTOStats",
    "LossNormalizer",
    "ORPOStats",
    "PolicyStats",
    "PreferenceLoss",
    "PreferenceMethod",
    "PreferenceStats",
    "RankingPairs",
    "RewardStats",
    "SFTStats",
    "Stats",
    "ValueStats",
    "bradley_terry_loss",
    "clipped_value_loss",
    "discounted_returns",
    "dpo_loss",
    "dr_grpo_advantages",
    "entropy_bonus",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "ipo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty_rewards",
    "kto_loss",
    "kto_reference_point",
    "loss_normalizer",
    "masked_whiten",
    "orpo_loss",
    "ppo_clip_loss",
    "rankings_to_pairs",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "sequence_logprob_mean",
    "sequence_logprob_sum",
    "sft_loss",
    "simpo_loss",
    "token_logprobs",
    "token_logprobs_naive",
    "token_mean",
    "value_loss",
]
