"""The recipe: one YAML file, typed and validated before anything runs.

Every field carries a one-line reason. Unknown keys and bad values are errors that name the file,
the key path and what was expected (`RecipeError`). Reading a recipe file (YAML, `key=value`
overrides, rounds, the error lines) is `runtime/recipe_file.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain.rewards.registry import VerifierName
from posttrain.runtime.allocator import HEAP_KEEP_BYTES
from posttrain.runtime.rounds import expand_rounds

# A stage name is a folder name under checkpoints/ and a key in every stream: letters, digits, `_`, `-`
# and `.` (a rounds copy is `r2.sft`), not starting with `.` or `-`.
STAGE_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the file, the key and what was expected."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(Strict):
    """LoRA adapters (Hu et al. 2021) via PEFT on every training stage; the base weights stay frozen (docs/lora.md)."""

    r: int = Field(16, gt=0, description="adapter rank: each adapted W (out, in) learns B (out, r) · A (r, in)")
    alpha: float = Field(32.0, gt=0, description="the update is scaled by alpha / r (PEFT's lora_alpha)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input in training (0: the update forward is deterministic)")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      min_length=1, description="names of the layers that get adapters (Llama/Qwen2 names; the fused decode path merges these and lm_head; a reward model or critic skips lm_head, its scalar head trains in full)")


class ModelConfig(Strict):
    init: str = Field("tiny-1m", description="a tiny preset to build from scratch (tiny-1m, tiny-4m, tiny-30m), a named built-in checkpoint (smollm2-135m-instruct: SmolLM2-135M-Instruct, offline), or a path to a local HF model folder")
    arch: Literal["llama", "qwen2"] = Field("llama", description="architecture of a preset built from scratch")
    max_seq_len: int = Field(160, gt=8, description="context length of a model built from scratch")
    vocab_size: int = Field(512, ge=300, description="target vocabulary of the tokenizer trained for a model built from scratch")
    attention: Literal["auto", "sdpa", "eager"] = Field("auto", description="attention kernels of the training forward: auto = eager on a CPU under bf16 for contexts ≤ 512 tokens (measured faster there), else the model's default (sdpa)")
    lora: LoraConfig | None = Field(None, description="LoRA adapters on every training stage, each stage a fresh adapter on the previous stage's merged weights (null = full fine-tuning)")


class DataSource(Strict):
    """Where a stage's examples come from: a task (`{task: arithmetic, n: 2000}`) or a JSONL file in our
    schemas (`{path: file.jsonl}`, docs/data.md). `world: arithmetic` is kept as an alias of `task`."""

    task: str | None = Field(None, description="a built-in task that supplies the split (arithmetic, arithmetic-tools, code, code-tools; docs/tasks.md)")
    path: Path | None = Field(None, description="a JSONL file in the documented schema of the stage")
    n: int | None = Field(None, gt=0, description="examples to draw from the task (required with `task`)")
    weight: float = Field(1.0, gt=0, description="share of this source in the mix")

    @model_validator(mode="before")
    @classmethod
    def _world_alias(cls, raw: Any) -> Any:
        # `world: arithmetic` (recipes written before the Task layer) reads as `task: arithmetic`
        if isinstance(raw, dict) and "world" in raw:
            if raw.get("task") is not None:
                raise ValueError("give `task` or its alias `world`, not both")
            raw = {**{k: v for k, v in raw.items() if k != "world"}, "task": raw["world"]}
        return raw

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        if (self.task is None) == (self.path is None):
            raise ValueError("give exactly one of `task` or `path`")
        if self.task is not None and self.n is None:
            raise ValueError("`n` (how many examples to draw) is required with `task`")
        _check_task(self.task)
        return self


def _check_task(name: str | None) -> None:
    from posttrain.tasks.registry import BUILTIN

    if name is not None and name not in BUILTIN:
        raise ValueError(f"unknown task {name!r}; expected one of {list(BUILTIN)} (a user's file: give `path`)")


def task_names(sources: list[DataSource]) -> list[str]:
    """The tasks a stage's data sources name, in order, once each."""
    return list(dict.fromkeys(s.task for s in sources if s.task is not None))


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0, description="peak AdamW learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr × this")
    warmup_steps: int = Field(20, ge=0, description="linear warmup from 0")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    fused: bool | None = Field(None, description="AdamW's fused kernel (true: PyTorch's numbers, on a CPU through posttrain's C step, which also writes the bf16 weight copies a bf16 forward reads), the single-tensor loop (false), or by model size (null: fused from 10M parameters)")
    max_nonfinite_skips: int = Field(3, ge=1, description="optimizer steps in a row skipped for a NaN/inf loss or gradient norm before the stage stops")


class StageBase(Strict):
    """Fields every stage has: its name (the checkpoint folder, and the `stage` of its metrics, phases
    and evals rows) and, for a copy made by a rounds block, its round."""

    name: str | None = Field(None, pattern=STAGE_NAME, description="checkpoint folder name; defaults to the stage kind (inside a rounds block: r<k>.<name>)")
    round: int | None = Field(None, ge=1, description="the round this stage is a copy for: set by a rounds block's expansion (docs/rounds.md), carried into its evals rows; null outside rounds")

    @property
    def folder(self) -> str:
        return self.name or self.stage  # type: ignore[attr-defined]


class TrainStage(StageBase):
    """Fields every optimizer-driven stage shares."""

    steps: int = Field(100, gt=0, description="optimizer steps")
    batch_size: int = Field(32, gt=0, description="sequences per optimizer step")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step (batch_size must divide by it)")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval_every: int = Field(0, ge=0, description="steps between in-stage evals (0 = only at the end)")
    save_every: int = Field(50, gt=0, description="steps between resumable checkpoints")
    keep_last: int = Field(2, gt=0, description="resumable checkpoints kept")
    log_every: int = Field(10, gt=0, description="steps between metrics.jsonl records")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the backward instead of keeping them: less memory for ~one more forward per step (docs/performance.md)")

    @model_validator(mode="after")
    def _accum_divides(self) -> TrainStage:
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by grad_accum {self.grad_accum}")
        return self


class PretrainStage(TrainStage):
    stage: Literal["pretrain"] = "pretrain"
    seq_len: int = Field(128, gt=8, description="packed tokens per row")
    documents: int = Field(50_000, gt=0, description="documents in the pretraining stream")
    task: Literal["arithmetic"] = Field("arithmetic", description="the task whose document stream is pretrained on (only `arithmetic` has one)")


class SFTStage(TrainStage):
    stage: Literal["sft"] = "sft"
    data: list[DataSource] = Field(min_length=1, description="demonstrations: tasks and/or JSONL files in the `sft` schema")
    max_len: int = Field(128, gt=8, description="longest example in tokens")
    truncation: Literal["error", "drop"] = Field("error", description="an over-long example: stop with an error, or drop it and count it")
    heldout: int = Field(256, ge=0, description="examples of the first data task held out for eval loss (0, or no task among the sources: none)")


class RewardSpec(Strict):
    """One verifier of an RLVR stage and its weight in the summed reward (docs/rewards.md, docs/rlvr.md)."""

    name: Literal["math", "format", "overlong", "length", "code", "gold", "reward_model"] = Field(description="a posttrain.rewards verifier, `gold`: the arithmetic world's gold judge, or `reward_model`: a trained reward model's normalized score (needs `stage`)")
    weight: float = Field(1.0, description="weight in the summed reward (0 = computed and logged only)")
    params: dict[str, Any] = Field(default_factory=dict, description="the verifier's parameters, e.g. {think: optional}")
    stage: str | None = Field(None, description="reward_model only: a reward_model stage of this run (its final checkpoint) or a reward-model folder (with reward_norm.json)")

    @model_validator(mode="after")
    def _reward_model_named(self) -> RewardSpec:
        if self.name == "reward_model":
            if not (self.stage or "").strip():
                raise ValueError("reward `reward_model` needs `stage`: a reward_model stage of this run or a reward-model folder")
            if self.params:
                raise ValueError(f"reward `reward_model` takes no params, got {sorted(self.params)}")
        elif self.stage is not None:
            raise ValueError(f"reward {self.name!r}: `stage` is for `reward_model` only")
        return self


class EnvSpec(Strict):
    """A multi-turn environment for an RL stage: each sample is an episode in it (docs/envs.md)."""

    name: Literal["tools", "code", "task"] = Field(description="a posttrain.envs environment (tools: calculator / python in the sandbox; code: visible tests through run_tests, hidden tests decide — problems with `tests` and `visible_tests`), or `task`: the environment the stage's first data task with one supplies (arithmetic-tools, code-tools)")
    params: dict[str, Any] = Field(default_factory=dict, description="the environment's parameters, e.g. {tools: [calculator]} (with `task`: overrides of the task's defaults)")
    max_turns: int = Field(4, gt=0, description="assistant turns per episode at most")
    max_tokens: int = Field(256, gt=1, description="tokens per episode at most: first prompt, model turns and environment text")
    tool_wait_s: float | None = Field(None, gt=0, description="None: lockstep rounds (reproducible); seconds: rows whose environment step takes longer join a later generate call")
    keep_kv: bool = Field(True, description="keep each episode's KV cache across its turns where the rollout engine can (native): a turn prefills only its new tokens (docs/envs.md)")


class AsyncRLFields(Strict):
    """The asynchronous-RL fields GRPO and PPO share (docs/async_rl.md): the staleness bound and the
    off-policy correction. A mixin of the stage classes, so both read the same definitions."""

    max_staleness: int = Field(0, ge=0, description="asynchronous RL (docs/async_rl.md): rollout i is sampled by a rollout thread with the policy after max(0, i − k) rollout updates while the learner trains; 0 = the synchronous loop")
    off_policy: Literal["none", "decoupled", "tis"] | None = Field(None, description="the off-policy correction (docs/async_rl.md): decoupled PPO (clip against the learner's proximal log-probs, tokens weighted by min(π_prox/π_behav, is_cap)); tis: the same formula, for the sampler/learner mismatch only (max_staleness 0); none: the clip against the behaviour log-probs. None: decoupled when max_staleness ≥ 1, else none")
    is_cap: float = Field(2.0, gt=0, description="truncation C of the importance weight min(π_prox/π_behav, C) (Yao et al. 2025 use 2)")

    @property
    def correction(self) -> str:
        """The off-policy correction in force: `off_policy`, or its default for `max_staleness`."""
        return self.off_policy or ("decoupled" if self.max_staleness else "none")

    @model_validator(mode="after")
    def _tis_is_fresh_only(self) -> AsyncRLFields:
        if self.off_policy == "tis" and self.max_staleness:
            raise ValueError(f"off_policy: tis corrects the sampler/learner mismatch of fresh rollouts only; with "
                             f"max_staleness {self.max_staleness} the rollouts are stale: use off_policy: decoupled")
        return self


class GRPOStage(TrainStage, AsyncRLFields):
    stage: Literal["grpo"] = "grpo"
    data: list[DataSource] = Field(min_length=1, description="problems (a task, or JSONL in the `problem` schema)")
    levels: list[str] | None = Field(None, description="levels of the data task to draw problems from (None: the task's level mix)")
    loss: Literal["grpo", "dapo", "dr_grpo"] = Field("grpo", description="advantage normalization, token aggregation and clip range (docs/rlvr.md)")
    batch_size: int = Field(128, gt=0, description="sequences per optimizer step (prompts × group_size)")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=3, min_lr_ratio=1.0), description="RL needs a far lower lr than SFT (docs/rlvr.md: 3e-4 already forgets, 1e-3 collapses)")
    group_size: int = Field(8, ge=2, description="samples per prompt (G)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass of the rollouts (1 = off)")
    max_new_tokens: int = Field(48, gt=0, description="completion budget per sample")
    max_prompt_len: int = Field(64, gt=0, description="longest prompt in tokens (longer ones are an error)")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="math")], description="verifiers summed into the reward (empty only with `env`: the environment's reward alone)")
    pass_threshold: float = Field(0.5, description="a sample passes when the first listed verifier scores at least this")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL-to-reference coefficient in the loss (0: no reference pass)")
    clip_low: float | None = Field(None, gt=0, lt=1, description="ratio floor 1 − clip_low (None: the loss's default)")
    clip_high: float | None = Field(None, gt=0, description="ratio ceiling 1 + clip_high (None: the loss's default)")
    mu: int = Field(1, gt=0, description="optimizer steps per rollout batch (μ); `steps` counts optimizer steps")
    dynamic_sampling: bool = Field(False, description="drop groups whose rewards are all equal and sample more (DAPO)")
    max_rounds: int = Field(4, gt=0, description="generation rounds per rollout batch at most when refilling")
    mask_truncated: bool = Field(False, description="leave samples cut by max_new_tokens out of the loss (DAPO overlong filtering)")
    backend: Literal["native", "hf", "vllm"] = Field("native", description="rollout engine (vllm: a CUDA GPU and the vllm extra; checked before the run starts)")
    release_rollout_memory: bool = Field(True, description="free the rollout engine's weight copies and decode forms before each update (the sync after it rebuilds them, as it must anyway): the update's memory peak holds none of them (docs/performance.md)")
    share_prompt: bool = Field(True, description="update and reference forwards pack each group as [prompt | c_1 | … | c_G], the prompt once and every completion at its own length, no padding (exact up to round-off; G·(P + N) → P + Σ n_j tokens)")
    eval_problems: int = Field(100, gt=0, description="held-out problems per eval level for the in-stage greedy eval (eval_every)")
    env: EnvSpec | None = Field(None, description="multi-turn: each sample is an episode in this environment, max_new_tokens is per turn, the loss falls on the model's tokens only (docs/envs.md)")

    @model_validator(mode="after")
    def _grpo_shapes(self) -> GRPOStage:
        if self.max_staleness and self.env is not None:
            raise ValueError("max_staleness is not supported with env yet (episodes run in the learner's loop); set it to 0")
        if not self.rewards and self.env is None:
            raise ValueError("rewards is empty: nothing would score the samples (an empty list is for `env`, "
                             "whose environment gives the reward)")
        if self.env is not None and self.dynamic_sampling:
            raise ValueError("dynamic_sampling is not supported with env yet (episodes are one round per rollout)")
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of group_size {self.group_size}")
        if self.steps % self.mu or self.save_every % self.mu:
            raise ValueError(f"steps {self.steps} and save_every {self.save_every} must be multiples of mu {self.mu} "
                             "(checkpoints fall between rollout batches)")
        return self


class CollectJudge(Strict):
    """An AI judge scoring the collect step's candidates (docs/judges.md, "In the collect step")."""

    backend: Literal["local", "endpoint"] = Field(description="local: an HF chat model through our rollout engine; endpoint: an OpenAI-compatible chat-completions server")
    mode: Literal["rubric", "pairwise"] = Field("rubric", description="rubric: each candidate rated 1–10 alone (one request each); pairwise: every pair of a prompt's finished candidates judged in both orders, a candidate's score its share of wins (ties ½) — K(K−1) requests per prompt")
    weight: float = Field(1.0, description="weight of the judge's score (in [0, 1]) in the summed score; 0: computed and logged only")
    checkpoint: str = Field("policy", description="local only: `policy` (the model generating the candidates judges them), a named checkpoint (smollm2-135m-instruct) or a model folder")
    base_url: str | None = Field(None, description="endpoint only: e.g. https://api.example.com/v1")
    model: str | None = Field(None, description="endpoint only: the served model's name")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="endpoint only: the environment variable holding the key (null: none); never written anywhere")
    budget: int | None = Field(None, gt=0, description="endpoint only: most HTTP attempts (replies are cached under <run dir>/judge_cache)")
    timeout_s: float = Field(60.0, gt=0, description="endpoint only: seconds per socket operation before an attempt fails (and is retried)")
    max_tokens: int = Field(32, gt=0, description="reply budget of one judgement (pairwise asks for a letter: 16 is plenty)")
    batch_size: int = Field(8, gt=0, description="local only: requests per generation call")
    rubric: str | None = Field(None, description="rubric mode: what the judge rates (None: judges.rubric.DEFAULT_RUBRIC — correct, then concise)")
    criteria: str | None = Field(None, description="pairwise mode: what makes a reply better (None: judges.pairwise.DEFAULT_CRITERIA)")

    @model_validator(mode="after")
    def _endpoint_named(self) -> CollectJudge:
        if self.backend == "endpoint" and (self.base_url is None or self.model is None):
            raise ValueError("judge: backend endpoint needs `base_url` and `model`")
        return self


class RejectionSamplingStage(StageBase):
    stage: Literal["rejection_sampling"] = "rejection_sampling"
    data: list[DataSource] = Field(min_length=1, description="problems (a task, or JSONL in the `problem` schema)")
    levels: list[str] | None = Field(None, description="levels of the data task to draw problems from (None: the task's level mix)")
    samples: int = Field(8, gt=0, description="samples per prompt (N)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass (1 = off)")
    max_new_tokens: int = Field(48, gt=0, description="completion budget per sample")
    max_prompt_len: int = Field(64, gt=0, description="longest prompt in tokens (longer ones are an error)")
    batch_prompts: int = Field(64, gt=0, description="prompts per generation call")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="math")], description="verifiers summed into the score (may be empty with a reward_model); the default, as GRPO's, judges any problem file — `gold` is the arithmetic world's graded judge")
    reward_model: str | None = Field(None, description="a reward_model stage of this run, or a reward-model folder: its normalized score (mean 0, std 1 on the start policy's samples) × reward_model_weight is added to the score")
    reward_model_weight: float = Field(1.0, description="weight of the reward model's normalized score in the summed score")
    keep: Literal["best", "all_correct"] = Field("best", description="per prompt: the best-scoring sample, or every sample at or above min_reward")
    min_reward: float = Field(0.5, description="a sample is kept only if its summed reward is at least this")
    output: Path | None = Field(None, description="where to write the SFT JSONL (default <run dir>/data/<name>.jsonl)")
    pairs: bool = Field(False, description="also write preference pairs: per prompt, its best sample (chosen, as `keep: best` picks it) against its lowest-scoring finished one (rejected)")
    pair_margin: float = Field(0.0, ge=0, description="a pair needs the chosen's summed reward above the rejected's by more than this")
    pairs_output: Path | None = Field(None, description="where to write the pairs, `preference` schema (default <run dir>/data/<name>.pairs.jsonl)")
    draw: int = Field(0, ge=0, description="which draw of a task's problems and of the sampling seeds: another draw, other prompts and samples (in a rounds block `draw: \"{round}\"` gives each round fresh prompts)")
    gates: list[Literal["exact_dedup", "near_dedup", "decontaminate"]] = Field(default_factory=list, description="quality gates on the rows before they are written, in order (docs/gates.md); decontaminate: against the recipe's evals; each gate's counts join the stage's summary metrics")
    judge: CollectJudge | None = Field(None, description="an AI judge (a local chat model or an endpoint, rubric or pairwise) whose score × judge.weight joins the summed score; its agreement with the task's gold judge, where the task has one, is logged as judge/agreement_with_gold (docs/judges.md)")
    teacher: str | None = Field(None, description="distillation: a stage of this run (its final checkpoint), a named checkpoint (smollm2-135m-instruct) or a model folder that generates the candidates instead of the current policy; it may differ in size and architecture, and brings its own tokenizer (prompts are encoded with it, candidates kept as text; docs/distillation.md). The stage's checkpoint stays the current policy (the student)")

    @model_validator(mode="after")
    def _scored(self) -> RejectionSamplingStage:
        if not self.rewards and self.reward_model is None and self.judge is None:
            raise ValueError("rewards is empty and no reward_model or judge is set: nothing would score the samples")
        if self.teacher is not None and not self.teacher.strip():
            raise ValueError("teacher: empty; name a stage of this run or a model folder (or leave it out)")
        return self

    @property
    def steps(self) -> int:
        """Generation calls (what the run's eval step counter reads)."""
        n = sum(s.n or 0 for s in self.data)
        return max(1, -(-n // self.batch_prompts))


def _check_constitution(path: Path | None) -> None:
    from posttrain.judges.constitution import load_constitution

    if path is not None:
        load_constitution(path)  # ConstitutionError (a ValueError) names the file, the principle and the field


class FeedbackModel(Strict):
    """Who critiques and revises (SL-CAI) or labels pairs (RL-CAI) against the constitution (docs/constitutional_ai.md)."""

    kind: Literal["rule", "local", "endpoint"] = Field(description="rule: each principle's checker and its rule reviser; local: an HF chat model; endpoint: an OpenAI-compatible server")
    checkpoint: str = Field("policy", description="local only: `policy` (the stage's start model: self-critique), a named checkpoint (smollm2-135m-instruct) or a model folder")
    base_url: str | None = Field(None, description="endpoint only: e.g. https://api.example.com/v1")
    model: str | None = Field(None, description="endpoint only: the served model's name")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="endpoint only: the environment variable holding the key (null: none)")
    budget: int | None = Field(None, gt=0, description="endpoint only: most HTTP attempts (replies are cached under <run dir>/judge_cache)")
    max_tokens: int = Field(64, gt=0, description="reply budget of a critique or revision (a pairwise label asks for 16)")
    batch_size: int = Field(8, gt=0, description="local only: requests per generation call")

    @model_validator(mode="after")
    def _endpoint_named(self) -> FeedbackModel:
        if self.kind == "endpoint" and (self.base_url is None or self.model is None):
            raise ValueError("kind endpoint needs `base_url` and `model`")
        return self


class ConstitutionalStage(StageBase):
    """What SL-CAI and RL-CAI share: prompts, the constitution, sampling from the start policy."""

    data: list[DataSource] = Field(min_length=1, description="prompts (a task's problems, or JSONL in the `problem` schema)")
    levels: list[str] | None = Field(None, description="levels of the data task to draw prompts from (None: the task's level mix)")
    constitution: Path = Field(description="the constitution YAML: a list of principles (name, critique, revision, optional preference and check)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the policy's responses")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass (1 = off)")
    max_new_tokens: int = Field(48, gt=0, description="response budget")
    max_prompt_len: int = Field(64, gt=0, description="longest prompt in tokens (longer ones are an error)")
    batch_prompts: int = Field(64, gt=0, description="prompts per generation call")
    output: Path | None = Field(None, description="the training data it writes (default <run dir>/data/<name>.jsonl)")
    records_output: Path | None = Field(None, description="the auditable feedback records (default <run dir>/data/<name>.records.jsonl)")
    draw: int = Field(0, ge=0, description="which draw of the task's problems and of the seeds (as rejection_sampling's)")

    @model_validator(mode="after")
    def _constitution_reads(self) -> ConstitutionalStage:
        _check_constitution(self.constitution)
        return self

    @property
    def steps(self) -> int:
        """Generation calls (what the run's eval step counter reads)."""
        n = sum(s.n or 0 for s in self.data)
        return max(1, -(-n // self.batch_prompts))


class ConstitutionalSLStage(ConstitutionalStage):
    """SL-CAI (Bai et al. 2022, §3): responses critiqued and revised against sampled principles → SFT data."""

    stage: Literal["constitutional_sl"] = "constitutional_sl"
    reviser: FeedbackModel = Field(default_factory=lambda: FeedbackModel(kind="rule"), description="who critiques and revises")
    revisions: int = Field(1, gt=0, description="critique → revision passes per response, each with a freshly sampled principle")
    keep: Literal["all", "changed"] = Field("all", description="SFT rows: every usable final revision (the paper), or only those that differ from the response")


class ConstitutionalRLStage(ConstitutionalStage):
    """RL-CAI's labelling (Bai et al. 2022, §4): pairs of the policy's samples judged against a sampled principle → preference data."""

    stage: Literal["constitutional_rl"] = "constitutional_rl"
    samples: int = Field(2, ge=2, description="samples per prompt, paired in sampling order (1, 2), (3, 4), …; even")
    judge: FeedbackModel = Field(default_factory=lambda: FeedbackModel(kind="rule"), description="the feedback model that labels the pairs")

    @model_validator(mode="after")
    def _even(self) -> ConstitutionalRLStage:
        if self.samples % 2:
            raise ValueError(f"samples {self.samples} must be even (samples are paired)")
        return self


class RewardModelStage(TrainStage):
    """Bradley–Terry reward model on the start policy's backbone (docs/preference.md)."""

    stage: Literal["reward_model"] = "reward_model"
    data: list[DataSource] = Field(default_factory=list, description="preference pairs (a task, or JSONL in the `preference` schema)")
    rankings: list[DataSource] = Field(default_factory=list, description="rankings of K ≥ 2 responses, best first (arithmetic task: K=3 gold-ordered; JSONL `ranking` schema), expanded to C(K,2) pairs")
    batch_size: int = Field(32, gt=0, description="pairs or rankings per optimizer step (a ranking counts once)")
    max_len: int = Field(128, gt=8, description="longest prompt + response in tokens")
    truncation: Literal["error", "left"] = Field("error", description="an over-long record: stop with an error, or drop prompt tokens from the left")
    heldout: int = Field(512, ge=0, description="pairs of the first data task held out for pair accuracy (per kind where the task says: style / correctness; no task among the sources: none)")
    norm_samples: int = Field(256, gt=1, description="start-policy samples scored to normalize the reward (mean 0, std 1) and to measure agreement with the gold judge")
    samples_per_prompt: int = Field(4, ge=2, description="start-policy samples per prompt in the gold-agreement check")
    max_new_tokens: int = Field(48, gt=0, description="answer budget of those samples")


class DPOStage(TrainStage):
    """The DPO family: offline preference optimization against the start policy (docs/preference.md)."""

    stage: Literal["dpo"] = "dpo"
    loss: Literal["dpo", "ipo", "kto", "orpo", "simpo"] = Field("dpo", description="objective (posttrain.losses.preference)")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=3e-5, warmup_steps=10), description="AdamW; DPO wants a small lr (at 1e-4 and β 0.1 the chosen log-probs collapse: likelihood displacement)")
    beta: float = Field(0.1, gt=0, description="β: DPO/KTO/IPO(τ) inverse temperature; ORPO's λ; SimPO's reward scale")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="DPO only: conservative-DPO label noise ε")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO only: target reward margin γ")
    kto_desirable_weight: float = Field(1.0, gt=0, description="KTO only: λ_D")
    kto_undesirable_weight: float = Field(1.0, gt=0, description="KTO only: λ_U")
    data: list[DataSource] = Field(min_length=1, description="pairs (a task, or JSONL `preference` schema); KTO: `unpaired` schema (a task's pairs are split into a good and a bad example)")
    batch_size: int = Field(16, gt=0, description="pairs (KTO: examples) per optimizer step")
    max_len: int = Field(128, gt=8, description="longest prompt + response in tokens")
    truncation: Literal["error", "left"] = Field("error", description="an over-long record: stop with an error, or drop prompt tokens from the left")
    reference: Literal["cached", "recompute"] = Field("cached", description="reference log-probs: computed once before training, or by a reference forward every step (same loss; for checking)")
    reference_batch: int = Field(64, gt=0, description="sequences per forward when caching reference log-probs")
    eval_per_level: int = Field(50, ge=0, description="held-out problems per level for the gold head-to-head against the start policy (0 = off; needs a data task with a gold judge)")
    eval_samples: int = Field(2, gt=0, description="sampled responses per problem and model in that head-to-head")
    eval_temperature: float = Field(1.0, ge=0, description="sampling temperature of the head-to-head (0 = greedy)")
    max_new_tokens: int = Field(48, gt=0, description="answer budget in the head-to-head")


class PPOStage(TrainStage, AsyncRLFields):
    """PPO-RLHF against a reward model under a KL penalty to the start policy (docs/preference.md)."""

    stage: Literal["ppo"] = "ppo"
    release_rollout_memory: bool = Field(True, description="free the rollout engine's weight copies and decode forms before each update (the sync after it rebuilds them, as it must anyway): the update's memory peak holds none of them (docs/performance.md)")
    reward_model: str = Field("reward_model", description="the reward_model stage's folder in this run, or a path to a reward-model checkpoint")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-5, warmup_steps=5, min_lr_ratio=1.0), description="the policy's AdamW (the schedule counts iterations); larger lr games the reward model sooner")
    data: list[DataSource] = Field(min_length=1, description="prompts (a task's problems, or JSONL in the `problem` schema)")
    levels: list[str] | None = Field(None, description="levels of the data task to draw prompts from (None: the task's level mix)")
    batch_size: int = Field(64, gt=0, description="rollouts (one per prompt) per PPO iteration; `steps` counts iterations")
    minibatch_size: int = Field(16, gt=0, description="rollouts per gradient step inside an iteration")
    ppo_epochs: int = Field(4, gt=0, description="passes over each iteration's rollouts")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")
    max_new_tokens: int = Field(48, gt=0, description="completion budget per rollout")
    max_prompt_len: int = Field(64, gt=0, description="longest prompt in tokens (longer ones are an error)")
    kl_coef: float = Field(0.05, ge=0, description="β of the per-token KL penalty (initial value when adaptive)")
    kl_target: float | None = Field(None, gt=0, description="adaptive KL controller's target (nats per sequence); None = fixed β")
    kl_horizon: float = Field(10_000, gt=0, description="adaptive controller's horizon in rollouts")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ")
    clip: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip ε")
    value_clip: float = Field(0.2, gt=0, description="value-loss clip around the rollout-time values")
    critic_lr: float = Field(1e-3, gt=0, description="peak learning rate of the critic (value model), same schedule as the policy")
    whiten_advantages: bool = Field(True, description="normalize advantages over each iteration's tokens")
    missing_eos_score: float | None = Field(-1.0, description="normalized score given to a rollout cut by max_new_tokens (None: keep the RM score)")
    eval_per_level: int = Field(50, ge=0, description="held-out problems per level for the gold comparison with the start policy (0 = off; needs a data task with a gold judge)")
    eval_samples: int = Field(2, gt=0, description="sampled responses per problem and model in that comparison")
    eval_temperature: float = Field(1.0, ge=0, description="sampling temperature of that comparison (0 = greedy)")

    @model_validator(mode="after")
    def _minibatches_divide(self) -> PPOStage:
        if self.batch_size % self.minibatch_size:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by minibatch_size {self.minibatch_size}")
        return self

Stage = Annotated[PretrainStage | SFTStage | GRPOStage | RejectionSamplingStage | RewardModelStage | DPOStage | PPOStage
                  | ConstitutionalSLStage | ConstitutionalRLStage, Field(discriminator="stage")]


class EvalSpec(Strict):
    """One held-out eval run after every stage: a built-in task (`{task: arithmetic, levels: [L1, L2]}`,
    `{task: humaneval, k: [1, 10]}`) or a `problem` JSONL file judged by a verifier
    (`{path: my_eval.jsonl, verifier: math}`). docs/tasks.md lists what each task reports."""

    task: str | None = Field(None, description="a built-in task: arithmetic, arithmetic-tools, code, code-tools, humaneval")
    path: Path | None = Field(None, description="a JSONL file in the `problem` schema (the `jsonl` task)")
    verifier: str | None = Field(None, description="the posttrain.rewards verifier that judges a reply to `path` (math, code, …)")
    params: dict[str, Any] = Field(default_factory=dict, description="that verifier's parameters")
    name: str | None = Field(None, description="eval name in evals.jsonl (default: the task's name, or the file's stem)")
    levels: list[str] | None = Field(None, description="levels to evaluate (None: every level the task has)")
    per_level: int | None = Field(None, gt=0, description="held-out problems per level, or in all for a task without levels (None: all; arithmetic: 200)")
    greedy: bool = Field(True, description="greedy pass@1 (arithmetic: format and exact match) per level")
    k: list[int] = Field(default_factory=list, description="sampled pass@k for these k (empty: none; humaneval: [1])")
    samples: int | None = Field(None, gt=0, description="samples per problem for pass@k (None: max(k))")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the pass@k samples")
    max_new_tokens: int = Field(48, gt=0, description="answer budget")
    batch_size: int = Field(128, gt=0, description="prompts (greedy) or sequences (sampled) per generation batch")
    probe: bool = Field(True, description="arithmetic only: the prose probe of held-out single-digit facts")
    constitution: Path | None = Field(None, description="also rule-check the greedy replies against this constitution's checked principles: compliance per principle and overall ± stderr (docs/constitutional_ai.md)")

    @model_validator(mode="after")
    def _one_source(self) -> EvalSpec:
        if (self.task is None) == (self.path is None):
            raise ValueError("give exactly one of `task` or `path`")
        _check_task(self.task)
        if self.path is not None and self.verifier is None:
            raise ValueError("`verifier` (e.g. math) is required with `path`: it judges each reply")
        if self.verifier is not None:
            known = [v.value for v in VerifierName]
            if self.verifier not in known:
                raise ValueError(f"unknown verifier {self.verifier!r}; expected one of {known}")
            if self.task is not None:
                raise ValueError("`verifier` goes with `path`; a built-in task judges replies its own way")
        if self.samples is not None and self.k and max(self.k) > self.samples:
            raise ValueError(f"every k must be ≤ samples={self.samples}, got k={self.k}")
        if any(k < 1 for k in self.k):
            raise ValueError(f"every k must be ≥ 1, got {self.k}")
        _check_constitution(self.constitution)
        return self

    @property
    def per_level_or_default(self) -> int | None:
        return self.per_level if self.per_level is not None or self.task not in ("arithmetic", "arithmetic-tools") else 200


class TelemetryConfig(Strict):
    peak_flops: float | None = Field(None, gt=0, description="override the device's dense peak FLOP/s at the run dtype")
    peak_bytes_per_s: float | None = Field(None, gt=0, description="override the device's memory bandwidth")
    measure_cpu: bool = Field(True, description="on a CPU without a cached measurement, measure the roofs (a few seconds) at start")
    busy_hz: float = Field(20.0, gt=0, le=1000, description="busy-line sampling rate")


class DoctorConfig(Strict):
    """The live doctor (docs/doctor.md): failure-mode rules run on the metrics as they are logged."""

    stop_on: Literal["critical", "warning"] | None = Field(None, description="stop the run at a finding this severe (its checkpoints kept, the reason in doctor.json; exit code 3); null = only report")
    every: int = Field(5, gt=0, description="run the rules every N logged records of a stage (cost: docs/doctor.md)")


class PlacementConfig(Strict):
    """Where the RL stages' rollout workers run (docs/placement.md): Ray actors, each with its own rollout
    engine, fed the learner's weights after every update. The learner stays in this process (or, with
    `posttrain run --launcher ray`, in Ray actors of its own: num_cpus_per_learner)."""

    mode: Literal["split", "colocated"] = Field("split", description="split: each worker reserves its own CPUs (num_cpus_per_worker); colocated: workers reserve none (they share the learner's devices) and release their weight copies and KV cache after every rollout")
    rollout_workers: int = Field(1, ge=1, description="Ray actors the prompts of a rollout are split over (prompt-major; the samples equal one engine's)")
    sync: Literal["full", "delta"] = Field("full", description="weights after an update: every tensor (full), or only the tensors that changed and, in a 16-bit wire dtype, only their changed elements (delta)")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs a worker reserves in split mode (Ray's resource accounting; its torch threads)")
    max_restarts: int = Field(2, ge=0, description="times a dead or timed-out worker is restarted (its request re-issued) before the run stops")
    timeout_s: float = Field(600.0, gt=0, description="seconds a worker's generate or sync may take before it is taken for dead")
    num_cpus_per_learner: float = Field(1.0, gt=0, description="CPUs each learner rank reserves when `posttrain run --launcher ray` starts the ranks as Ray actors (docs/placement.md, \"The learner in Ray actors\")")


# ---- data-parallel training (docs/distributed.md) ------------------------------------------------------------
class DistributedConfig(Strict):
    """How the training stages use the ranks torchrun starts (one process: the plain model either way)."""

    strategy: Literal["replicate", "fsdp"] = Field("replicate", description="replicate: every rank holds the whole model and AdamW state, gradients summed once per step; fsdp: parameters, gradients and AdamW state sharded over the ranks (FSDP2 fully_shard per decoder layer), checkpoints sharded through torch.distributed.checkpoint")


class Recipe(Strict):
    name: str = Field("run", description="run folder name under runs/")
    seed: int = Field(0, description="seeds the model init and every RNG")
    device: str = Field("cpu", description="torch device")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="training precision (bf16 = autocast, fp32 master weights)")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads (default: torch's)")
    mmap_threshold_mib: float | None = Field(32.0, gt=0, le=32, description="CPU tensors of at least this many MiB get their own memory mapping, returned to the OS when freed (glibc's mallopt; posttrain/runtime/allocator.py). Lower trades time for memory: at 4, long sequences peak lower but every large activation is page-faulted in again each step (docs/performance.md); null = glibc's dynamic thresholds (and heap_keep_mib unused)")
    heap_keep_mib: float = Field(HEAP_KEEP_BYTES / 2**20, gt=0, le=2047, description="free memory the heap keeps at its top instead of handing it back to the OS (glibc's trim threshold; at least twice mmap_threshold_mib): a step's freed activations and gradients are reused by the next one, not page-faulted in again. The resident set stays near the peak between steps (posttrain/runtime/allocator.py)")
    world_seed: int = Field(0, description="seed of the arithmetic task's world (its splits and held-out problems)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    evals: list[EvalSpec] = Field(default_factory=list, description="held-out evals after every stage (and of a loaded start): exactly these, none by default")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    doctor: DoctorConfig = Field(default_factory=DoctorConfig)
    placement: PlacementConfig | None = Field(None, description="rollout workers as Ray actors (the `ray` extra; docs/placement.md); null = everything in this process")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="data-parallel strategy when launched on several ranks (docs/distributed.md)")
    stages: list[Stage] = Field(min_length=1, description="the stages in order; an item `rounds: {repeat: N, stages: [...]}` is that block N times (docs/rounds.md)")

    @model_validator(mode="before")
    @classmethod
    def _old_eval_key(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "eval" in raw:
            raise ValueError("`eval` is now `evals`, a list naming each eval, e.g. "
                             "`evals: [{task: arithmetic, levels: [L1, L2, L3, L4], per_level: 200}]` (docs/tasks.md)")
        return raw

    @model_validator(mode="before")
    @classmethod
    def _expand_rounds(cls, raw: Any) -> Any:
        # load_recipe expands first (its errors name the file); this serves Recipe.model_validate(dict)
        return expand_rounds(raw)[0] if isinstance(raw, dict) else raw

    def task_names(self) -> list[str]:
        """Every task the recipe names (data sources, a pretrain stream, evals), in order, once each."""
        names: list[str] = []
        for s in self.stages:
            if isinstance(s, PretrainStage):
                names.append(s.task)
            names += task_names(list(getattr(s, "data", [])) + list(getattr(s, "rankings", [])))
        names += [e.task for e in self.evals if e.task is not None]
        return list(dict.fromkeys(names))

    def arithmetic_eval_per_level(self, task: str = "arithmetic") -> int:
        """Held-out problems per level a world task (arithmetic, arithmetic-tools) must keep back (the largest eval's)."""
        return max([e.per_level_or_default or 0 for e in self.evals if e.task == task] + [0])

    @model_validator(mode="after")
    def _unique_folders(self) -> Recipe:
        names = [s.folder for s in self.stages]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"two stages write the same checkpoint folder {sorted(dup)}; give them distinct `name`s")
        return self
