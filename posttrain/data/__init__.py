"""Data: typed records, validated JSONL / HF-datasets readers, chat templates with response-only loss
masks, batching (padding, packing, weighted mixes) and a resumable epoch sampler. Schemas: docs/data.md."""

from posttrain.data.batching import (
    PreferenceBatch,
    SFTBatch,
    collate_preference,
    collate_sft,
    mix,
    mix_indices,
    mix_quotas,
    pack_documents,
)
from posttrain.data.encoding import (
    IGNORE_INDEX,
    EncodedCompletion,
    EncodedPreference,
    EncodedSFT,
    TemplateError,
    encode_completion,
    encode_preference,
    encode_preference_dataset,
    encode_prompt,
    encode_sft,
    encode_sft_dataset,
    encode_unpaired,
    has_generation_markers,
    response_mask,
)
from posttrain.data.readers import (
    SCHEMAS,
    ReadReport,
    ReadResult,
    from_hf_dataset,
    parse_record,
    read_jsonl,
)
from posttrain.data.records import (
    KINDS,
    ROLES,
    DataError,
    Message,
    PreferencePair,
    Problem,
    Prompt,
    Ranking,
    Record,
    SFTExample,
    UnpairedExample,
    prompt_messages,
)
from posttrain.data.sampler import BatchIterator, EpochSampler

__all__ = [
    "IGNORE_INDEX", "KINDS", "ROLES", "SCHEMAS", "BatchIterator", "DataError", "EncodedCompletion",
    "EncodedPreference", "EncodedSFT", "EpochSampler", "Message", "PreferenceBatch", "PreferencePair", "Problem",
    "Prompt", "Ranking", "ReadReport", "ReadResult", "Record", "SFTBatch", "SFTExample", "TemplateError",
    "UnpairedExample", "collate_preference", "collate_sft", "encode_completion", "encode_preference",
    "encode_preference_dataset", "encode_prompt", "encode_sft", "encode_sft_dataset", "encode_unpaired",
    "from_hf_dataset", "has_generation_markers", "mix", "mix_indices", "mix_quotas", "pack_documents",
    "parse_record", "prompt_messages", "read_jsonl", "response_mask",
]
