"""The stage contract, below the stages: the typed recipe (`config`), what every stage is handed
(`context`: RunContext, StageResult) and how it saves and resumes (`checkpoint`). Orchestration —
running stages in order, evals between them — is `posttrain.pipeline`, above the stages."""
