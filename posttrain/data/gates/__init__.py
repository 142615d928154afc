"""Quality gates over typed records: exact and near-duplicate removal, decontamination against eval
prompts, length and format filters. Each gate is a pure function `records -> GateResult(kept, report)`;
the report counts what it removed, by reason, with a few examples. Thresholds and why: docs/gates.md.

Modules: `text` (what a gate reads of a record; normalization), `report` (GateReport, run_gates),
`dedup` (exact; MinHash LSH near-duplicates via datasketch), `decontam` (n-gram coverage of eval
prompts), `filters` (length, format).
"""

from posttrain.data.gates.decontam import DECONTAM_N, DECONTAM_THRESHOLD, EvalIndex, coverage, decontaminate, eval_index
from posttrain.data.gates.dedup import (
    NEAR_THRESHOLD,
    exact_dedup,
    jaccard,
    lsh_bands,
    near_dedup,
    near_dedup_exact,
    shingles,
)
from posttrain.data.gates.filters import FORBIDDEN_TOKENS, LengthUnit, format_filter, format_problem, length_filter
from posttrain.data.gates.report import Gate, GateReport, GateResult, Removed, run_gates
from posttrain.data.gates.text import Part, normalize, record_parts, record_text, words

__all__ = [
    "DECONTAM_N", "DECONTAM_THRESHOLD", "FORBIDDEN_TOKENS", "NEAR_THRESHOLD", "EvalIndex", "Gate", "GateReport",
    "GateResult", "LengthUnit", "Part", "Removed", "coverage", "decontaminate", "eval_index", "exact_dedup",
    "format_filter", "format_problem", "jaccard", "length_filter", "lsh_bands", "near_dedup", "near_dedup_exact",
    "normalize", "record_parts", "record_text", "run_gates", "shingles", "words",
]
