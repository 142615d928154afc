"""AI judges behind one interface: pairwise (both orders, a tie when they disagree) and scalar rubric
judging over a chat backend — a local HF chat model through our rollout engine, or an
OpenAI-compatible endpoint (key from the environment, retries, timeouts, a request budget, an on-disk
reply cache) — and agreement with a task's gold judge. docs/judges.md.

Modules: `backend` (ChatRequest, the ChatBackend protocol, errors), `local` (LocalChatBackend),
`endpoint` (EndpointBackend), `cache` (ResponseCache), `pairwise`, `rubric` (and RubricVerifier),
`agreement` (gold_agreement); Constitutional AI: `constitution` (the principles file), `checkers` (rule
checkers and the rule revisers derived from them), `feedback` (critique → revision and pairwise labels by a
chat model or a rule). docs/constitutional_ai.md.
"""

from posttrain.judges.agreement import Agreement, gold_agreement, pairs_from_scores, pairwise_gold_agreement
from posttrain.judges.checkers import CHECKERS, Verdict, split_reply, work_result
from posttrain.judges.constitution import Constitution, ConstitutionError, Principle, load_constitution, parse_constitution
from posttrain.judges.feedback import (
    ChatLabeler,
    ChatReviser,
    Labeler,
    Reviser,
    Revision,
    RuleLabeler,
    RuleReviser,
    gold_of_pair,
)
from posttrain.judges.backend import BudgetExhausted, ChatBackend, ChatRequest, JudgeBackendError
from posttrain.judges.cache import ResponseCache, request_key
from posttrain.judges.endpoint import EndpointBackend, EndpointStats
from posttrain.judges.local import LocalChatBackend
from posttrain.judges.pairwise import (
    PairJudgement,
    PairwiseCounts,
    Winner,
    combine_orders,
    count_pairs,
    judge_pairs,
    pair_request,
    parse_choice,
)
from posttrain.judges.rubric import RubricResult, RubricVerifier, judge_scores, parse_score, rubric_request

__all__ = [
    "CHECKERS", "ChatLabeler", "ChatReviser", "Constitution", "ConstitutionError", "Labeler", "Principle", "Reviser",
    "Revision", "RuleLabeler", "RuleReviser", "Verdict", "gold_of_pair", "load_constitution", "parse_constitution",
    "split_reply", "work_result",
    "Agreement", "BudgetExhausted", "ChatBackend", "ChatRequest", "EndpointBackend", "EndpointStats",
    "JudgeBackendError", "LocalChatBackend", "PairJudgement", "PairwiseCounts", "ResponseCache", "RubricResult",
    "RubricVerifier", "Winner", "combine_orders", "count_pairs", "gold_agreement", "judge_pairs", "judge_scores",
    "pair_request", "pairs_from_scores", "pairwise_gold_agreement", "parse_choice", "parse_score", "request_key",
    "rubric_request",
]
