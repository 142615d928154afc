"""Rejection sampling: N samples per prompt from the current policy, scored, the best kept as SFT data.

References: Llama 2 (Touvron et al. 2023), §3.2.3 "Rejection Sampling": sample K outputs per prompt,
keep the best by the reward, fine-tune on them; Llama 3 (Dubey et al. 2024), §4.2.2; DeepSeek-R1
(2025), §2.3.3: rejection sampling on the RL checkpoint with rule-based verifiers, keeping only
correct responses, for the next SFT round. Scoring is by verifiers (`rewards`, e.g. the arithmetic
world's gold judge `{name: gold}`), by a trained reward model (`reward_model`: its normalized score
at the reply's last token, × `reward_model_weight`), or by their sum (Llama 2's setting is the
reward model alone: `rewards: []`).

What it writes: an SFT dataset in our JSONL schema (docs/data.md, kind `sft`), one
`{"messages": [...prompt turns, {"role": "assistant", ...}], "reward", "level", "answer"}` row per
kept sample, at `output` (default `<run dir>/data/<name>.jsonl`); with `pairs: true`, preference
pairs (kind `preference`: the prompt's best sample against its worst, Llama 3's §4.2.1 setting with a
judge in place of the reward model) at `pairs_output`; and, so the pipeline can treat it like any
stage, `checkpoints/<name>/final/` holding the unchanged policy. A following `sft` (or `dpo`) stage
names the file as a data source (docs/rlvr.md, "Hand-off"; docs/rounds.md for the loop).

Departures (numbered):
1. A sample cut by `max_new_tokens` is never kept (it did not end its turn), whatever its score;
   nor is an empty completion.
2. Deduplication is by (prompt, completion with whitespace runs collapsed), across the whole
   dataset; among duplicates the first sample is kept.
3. `keep: best` keeps the highest summed reward at or above `min_reward`; ties go to the shorter
   completion (then the first sampled). Prompts with no sample at or above `min_reward` contribute
   nothing and are counted (`rs/prompts_without_keep`).
4. No step checkpoints; a journal instead (`_collect_journal.py`): each judged generation batch is
   appended to `<run dir>/journal/<name>.jsonl` before the next starts, and a killed stage resumes
   after its last complete batch — those batches are replayed from the journal, neither generated nor
   judged again (`rs/batches_replayed`, `rs/batches_judged`). Every sample is seeded by the recipe
   seed and the batch index, so the resumed stage writes byte-identical data files. The dataset is
   written atomically, before `final/` is published, so a `final/` always has its dataset.
5. The `final/` checkpoint is a copy of the start weights (the pipeline resumes by looking for it);
   for a large model that copy costs disk, not correctness.
6. A pair's chosen is the prompt's best sample when it reaches `min_reward`; its rejected is the
   lowest-scoring sample that ended its turn (ties: the longer, then the first), and the pair is
   written only if the two differ by more than `pair_margin`. A truncated or empty sample is never
   part of a pair (its score judges no finished reply).
7. Distillation (DeepSeek-R1 §2.4: SFT a smaller model on a stronger one's verified traces): with
   `teacher`, the teacher model generates the candidates, with its own tokenizer; the candidates
   are judged and kept as text, so the student's SFT re-tokenizes them with the run's tokenizer
   (teacher and student may differ in size, architecture and vocabulary). A `reward_model` scores
   token ids, so with a teacher it needs the teacher's tokenizer to be the run's (checked).
   `final/` holds the current policy (the student), not the teacher.
8. With `gates`, the rows to be written pass through the quality gates (exact / near dedup,
   decontamination against the recipe's evals; `_collect_gates.py`), their counts logged as
   `gate/…` metrics with the stage's summary row — per round inside a rounds block.
9. With `judge`, an AI judge (a local chat model or an OpenAI-compatible endpoint; rubric or pairwise)
   scores the finished candidates in the `score` phase, its score × `judge.weight` added to the sum,
   and its agreement with the task's gold judge logged (`_collect_judge.py`, docs/judges.md).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from posttrain.data import Problem, prompt_messages, read_jsonl
from posttrain.models import NAMED_CHECKPOINTS, checkpoint_folder, load_tokenizer
from posttrain.runtime.checkpoint import final_checkpoint
from posttrain.runtime.checkpoint import save_checkpoint
from posttrain.runtime.config import Recipe, RejectionSamplingStage
from posttrain.runtime.context import RunContext, StageResult
from posttrain.rewards import WeightedVerifier
from posttrain.rollout import Rollout, SamplingParams
from posttrain.stages._collect_judge import gold_task, judge_backend, judge_batch, pooled, with_judge
from posttrain.stages._collect_gates import gate_metrics, gate_rows, recipe_eval_index
from posttrain.stages._collect_journal import Journal, JudgedBatch, fingerprint, journal_path, read_journal
from posttrain.stages._learned_reward import (
    RewardModelScorer,
    resolve_policy,
    resolve_reward_model,
)
from posttrain.stages._rlvr import (
    build_rewards,
    close_rewards,
    encode_problems,
    load_problems,
    load_reward_models,
    score_rollout,
)
from posttrain.telemetry import costs

SEED_OFFSET = 1_000  # world problems distinct from a GRPO stage's (which draws with offset 0)
DRAW_STRIDE = 100  # draw d reads problems at SEED_OFFSET + 100·d (+ the source's index), samples at seed + 10_007·d
_SPACES = re.compile(r"\s+")


def output_path(cfg: RejectionSamplingStage, run_dir: Path) -> Path:
    """Where the stage writes its SFT JSONL."""
    return cfg.output if cfg.output is not None else run_dir / "data" / f"{cfg.folder}.jsonl"


def pairs_path(cfg: RejectionSamplingStage, run_dir: Path) -> Path:
    """Where the stage writes its preference pairs (with `pairs: true`)."""
    return cfg.pairs_output if cfg.pairs_output is not None else run_dir / "data" / f"{cfg.folder}.pairs.jsonl"


def produced_paths(recipe: Recipe, run_dir: Path) -> dict[Path, int]:
    """Files the recipe's rejection-sampling stages will write → the index of the stage writing each
    (resolved paths), so input validation can accept a later stage's `data: [{path: ...}]` naming one."""
    out: dict[Path, int] = {}
    for i, s in enumerate(recipe.stages):
        if isinstance(s, RejectionSamplingStage):
            out[output_path(s, run_dir).resolve()] = i
            if s.pairs:
                out[pairs_path(s, run_dir).resolve()] = i
    return out


def check_teachers(recipe: Recipe) -> None:
    """Every rejection-sampling `teacher` names an earlier stage of the recipe or a folder holding a
    model (config.json) and its tokenizer — checked before anything is written. Raises ValueError
    naming `stages[i].teacher`."""
    folders = [s.folder for s in recipe.stages]
    for i, s in enumerate(recipe.stages):
        if not isinstance(s, RejectionSamplingStage) or s.teacher is None:
            continue
        if s.teacher in NAMED_CHECKPOINTS:  # a built-in checkpoint (smollm2-135m-instruct): resolved when the stage runs
            continue
        if s.teacher in folders:
            j = folders.index(s.teacher)
            if j >= i:
                raise ValueError(f"stages[{i}].teacher: {s.teacher!r} is stages[{j}], which "
                                 f"{'is this stage' if j == i else 'runs later'}; a teacher must be trained first")
            continue
        folder = Path(s.teacher)
        if not (folder / "config.json").is_file():
            raise ValueError(f"stages[{i}].teacher: {s.teacher!r} is neither a stage of this run (stages: {folders}), "
                             f"a named checkpoint ({', '.join(NAMED_CHECKPOINTS)}) nor a model folder with a config.json")
        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"stages[{i}].teacher: {s.teacher!r} holds a model but no tokenizer (tokenizer.json); "
                             f"the teacher generates with its own tokenizer")


def resolve_teacher(ctx: RunContext, name: str, stage: str) -> Path:
    """The teacher `name`: a finished stage of this run (its final/), or a model folder."""
    in_run = final_checkpoint(ctx.stage_dir(name))
    path = in_run or checkpoint_folder(name)  # a named built-in checkpoint, or a folder
    if not (path / "config.json").is_file():
        raise ValueError(f"{stage}: teacher {name!r} is neither a finished stage of this run "
                         f"({ctx.stage_dir(name)}/final) nor a model folder with a config.json")
    return path


def select(problem: Problem, texts: list[str], rewards: list[float | None], finish: list[str], *,
           keep: str, min_reward: float) -> tuple[list[tuple[str, float]], dict[str, int]]:
    """One prompt's kept (completion, reward) pairs and why the others were not kept.

    Candidates: judged, not truncated, reward ≥ min_reward. `best`: the top reward (shorter wins a
    tie, then the first); `all_correct`: every candidate, duplicates (whitespace-collapsed) dropped.
    """
    counts = {"truncated": 0, "empty": 0, "unjudged": 0, "below_min": 0, "duplicates": 0}
    seen: set[str] = set()
    cands: list[tuple[str, float]] = []
    for text, r, why in zip(texts, rewards, finish):
        if why == "length":
            counts["truncated"] += 1
        elif not text.strip():  # nothing to imitate (and not a valid SFT turn)
            counts["empty"] += 1
        elif r is None:
            counts["unjudged"] += 1
        elif r < min_reward:
            counts["below_min"] += 1
        else:
            key = _SPACES.sub(" ", text.strip())
            if key in seen:
                counts["duplicates"] += 1
            else:
                seen.add(key)
                cands.append((text.strip(), r))
    if keep == "best" and cands:
        best = min(range(len(cands)), key=lambda i: (-cands[i][1], len(cands[i][0]), i))
        cands = [cands[best]]
    return cands, counts


def best_and_worst(texts: list[str], rewards: list[float | None], finish: list[str], *, min_reward: float,
                   margin: float) -> tuple[tuple[str, float], tuple[str, float]] | None:
    """One prompt's preference pair ((chosen, reward), (rejected, reward)), or None. Among the samples
    that ended their turn non-empty and were judged: chosen = the best (≥ min_reward; shorter wins a
    tie, then the first), rejected = the worst (longer loses a tie, then the first); None unless the
    chosen's reward exceeds the rejected's by more than `margin`."""
    done = [(t.strip(), r) for t, r, why in zip(texts, rewards, finish) if why != "length" and t.strip() and r is not None]
    if not done:
        return None
    best = min(range(len(done)), key=lambda i: (-done[i][1], len(done[i][0]), i))
    worst = min(range(len(done)), key=lambda i: (done[i][1], -len(done[i][0]), i))
    if done[best][1] < min_reward or done[best][1] - done[worst][1] <= margin:
        return None
    return done[best], done[worst]


def sft_row(problem: Problem, completion: str, reward: float) -> dict:
    """A kept sample as one line of our SFT schema (extra columns land in the record's `meta`)."""
    messages = [m.as_dict() for m in prompt_messages(problem.prompt)]
    return {"messages": messages + [{"role": "assistant", "content": completion}], "reward": round(reward, 6),
            "level": problem.level, "answer": problem.answer}


def pair_row(problem: Problem, chosen: tuple[str, float], rejected: tuple[str, float]) -> dict:
    """A pair as one line of our preference schema (rewards, level and answer land in `meta`)."""
    return {"prompt": [m.as_dict() for m in prompt_messages(problem.prompt)], "chosen": chosen[0], "rejected": rejected[0],
            "chosen_reward": round(chosen[1], 6), "rejected_reward": round(rejected[1], 6),
            "level": problem.level, "answer": problem.answer}


def add_pair(rows: list[dict], seen: set[tuple[str, str, str]], problem: Problem, key_prompt: str,
             pair: tuple[tuple[str, float], tuple[str, float]] | None) -> bool:
    """Append `pair` to `rows` as a preference row unless it is None or already there (same prompt,
    chosen and rejected, whitespace collapsed). True if appended."""
    if pair is None:
        return False
    key = (key_prompt, _SPACES.sub(" ", pair[0][0]), _SPACES.sub(" ", pair[1][0]))
    if key in seen:
        return False
    seen.add(key)
    rows.append(pair_row(problem, *pair))
    return True


def score(verifiers: Sequence[WeightedVerifier], scorer: RewardModelScorer | None, weight: float, ro: Rollout,
          problems: list[Problem]) -> tuple[list[float | None], dict[str, float]]:
    """Each row's summed score — Σ verifier weights · scores, plus weight · the reward model's normalized
    score — and the metrics. None where a verifier could not judge the row (it is then never kept)."""
    if verifiers:
        scored = score_rollout(verifiers, ro, problems)
        total, metrics = list(scored.total), scored.metrics()
    else:
        total, metrics = [0.0] * len(ro), {}
    if scorer is not None:
        rm = scorer(ro).tolist()
        total = [None if t is None else t + weight * s for t, s in zip(total, rm)]
        metrics["reward/reward_model"] = sum(rm) / len(rm)
        judged = [t for t in total if t is not None]
        if judged:
            metrics["reward/total"] = sum(judged) / len(judged)
    return total, metrics


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Atomic: a temporary sibling, then one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_rejection_sampling(cfg: RejectionSamplingStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    stage = cfg.folder
    policy = resolve_policy(ctx)  # after a reward_model stage, the policy it was built for
    teacher = resolve_teacher(ctx, cfg.teacher, stage) if cfg.teacher is not None else None
    gen_path = teacher or policy  # whose samples are judged
    tok = load_tokenizer(teacher) if teacher is not None else ctx.tokenizer  # the generator's own tokenizer
    problems = load_problems(ctx, cfg.data, levels=cfg.levels, seed_offset=SEED_OFFSET + DRAW_STRIDE * cfg.draw)
    prompts = encode_problems(problems, tok, cfg.max_prompt_len)
    scorer = (RewardModelScorer(resolve_reward_model(ctx, cfg.reward_model, stage), ctx.device)
              if cfg.reward_model is not None else None)
    uses_rm = scorer is not None or any(r.name == "reward_model" for r in cfg.rewards)
    if uses_rm and teacher is not None and tok.get_vocab() != ctx.tokenizer.get_vocab():
        rm = cfg.reward_model or next(r.stage for r in cfg.rewards if r.name == "reward_model")
        raise ValueError(f"{stage}: teacher {cfg.teacher!r} has another tokenizer than the run's, and reward_model "
                         f"{rm!r} scores the run's token ids; use verifiers (`rewards`) alone with this teacher")
    out_path = output_path(cfg, ctx.run_dir)
    pairs_out = pairs_path(cfg, ctx.run_dir) if cfg.pairs else None
    n_steps = -(-len(problems) // cfg.batch_prompts)
    # Batches already judged by a killed run of this stage: replayed below, neither generated nor judged again.
    jpath = journal_path(ctx.run_dir, stage)
    fp = fingerprint(cfg.model_dump_json(), prompts)  # the config names the teacher; the policy is the run's
    journaled, note = read_journal(jpath, fp)
    journaled = journaled[:n_steps]
    if note:
        ctx.console.print(f"[yellow]{stage}: {note}" + (f"; resuming after batch {len(journaled)} of {n_steps}" if journaled else ""))
    verifiers = build_rewards(cfg.rewards)
    load_reward_models(verifiers, ctx, stage)
    model = engine = None
    if len(journaled) < n_steps:  # something left to generate
        model = ctx.load_model(gen_path)
        engine = ctx.rollout_engine(model, tokenizer=tok)
        with ctx.phase("sync", stage=stage, step=len(journaled) + 1) as ph:  # the sampler's weights into the engine, once
            ph.cost = costs.Cost(bytes=engine.sync_weights(model))
    judge_chat = gold = None  # the AI judge's backend, built only when there is something to judge; the gold that measures it
    if cfg.judge is not None:
        gold = gold_task(ctx, cfg.data)
        if model is not None:
            judge_chat = judge_backend(cfg.judge, ctx, model, tok, engine)
    scored_by = [f"{r.name}×{r.weight:g}" for r in cfg.rewards]
    if scorer is not None:
        scored_by.append(f"reward model {scorer.path}×{cfg.reward_model_weight:g}")
    if cfg.judge is not None:
        scored_by.append(f"{cfg.judge.mode} judge ({cfg.judge.backend}"
                         + (f" {cfg.judge.checkpoint}" if cfg.judge.backend == "local" else f" {cfg.judge.model}")
                         + f")×{cfg.judge.weight:g}" + ("" if gold is None else f", measured against {gold.name}'s gold judge"))
    ctx.console.print(f"{stage}: {len(problems):,} prompts × N={cfg.samples} samples at T={cfg.temperature}"
                      + (f" from teacher {gen_path}" if teacher is not None else "") + f"; keep "
                      f"{cfg.keep} with summed reward ≥ {cfg.min_reward} ({', '.join(scored_by)}) → {out_path}"
                      + (f"; best-vs-worst pairs (margin > {cfg.pair_margin}) → {pairs_out}" if pairs_out else ""))

    def judge(step: int, idx: list[int]) -> JudgedBatch:
        """Generate and judge one batch of prompts: what a resume never does twice."""
        params = SamplingParams(n=cfg.samples, temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens,
                                seed=ctx.recipe.seed * 1_000_003 + 10_007 * cfg.draw + step)
        with ctx.phase("generate", stage=stage, step=step) as p:
            ro: Rollout = engine.generate([prompts[i] for i in idx], params)
            p.cost = engine.decode_cost(batch=len(ro), prompt_len=ro.prompt_ids.shape[1],
                                        new_tokens=max(1, ro.completion_ids.shape[1]), samples=params.n)
        rm_cost = None if scorer is None else costs.forward(
            scorer.model.config, batch=len(ro), seq_len=ro.sequence_ids.shape[1], logits="scalar")
        with ctx.phase("score", stage=stage, step=step, cost=rm_cost):  # the reward model's forward, the judge's requests
            total, metrics = score(verifiers, scorer, cfg.reward_model_weight, ro, [problems[i] for i in idx])
            if judge_chat is not None and cfg.judge is not None:
                rows = [problems[idx[k]] for k in ro.prompt_index.tolist()]
                g = gold.gold_rewards(rows, ro.texts, ro.finish_reason) if gold is not None else None
                judged = judge_batch(judge_chat, cfg.judge, rows, ro.texts, ro.finish_reason, cfg.samples, g)
                total, judge_m = with_judge(total, judged, cfg.judge.weight)
                metrics.update({**judged.metrics, **judge_m})
        return JudgedBatch(step, list(ro.texts), list(ro.finish_reason), list(total), metrics)

    # ---- loop ----------------------------------------------------------------------------------
    rows: list[dict] = []
    pair_rows: list[dict] = []
    seen_pairs: set[tuple[str, str]] = set()
    seen_prefs: set[tuple[str, str, str]] = set()  # (prompt, chosen, rejected), whitespace-collapsed
    totals = {"truncated": 0, "empty": 0, "unjudged": 0, "below_min": 0, "duplicates": 0, "prompts_without_keep": 0,
              **({"prompts_without_pair": 0} if cfg.pairs else {})}
    samples = passes = 0
    last: dict[str, float] = {}
    batch_metrics: list[dict[str, float]] = []  # every batch's, replayed ones too: the judge's pooled counts
    journal = Journal(jpath, stage, fp, keep=len(journaled))
    try:
        with ctx.progress() as bar:
            task = bar.add_task(stage, total=n_steps, completed=0, info="")
            for step, start in enumerate(range(0, len(problems), cfg.batch_prompts), 1):
                idx = list(range(start, min(start + cfg.batch_prompts, len(problems))))
                if step <= len(journaled):
                    batch = journaled[step - 1]
                else:
                    batch = judge(step, idx)
                    journal.append(batch)  # durable before the next batch starts
                total, texts, finish = batch.total, batch.texts, batch.finish
                batch_metrics.append(batch.metrics)
                kept_before = len(rows)
                for j, i in enumerate(idx):
                    sl = slice(j * cfg.samples, (j + 1) * cfg.samples)
                    kept, counts = select(problems[i], texts[sl], total[sl], finish[sl],
                                          keep=cfg.keep, min_reward=cfg.min_reward)
                    key_prompt = json.dumps([m.as_dict() for m in prompt_messages(problems[i].prompt)])
                    new = [(c, r) for c, r in kept if (key_prompt, _SPACES.sub(" ", c)) not in seen_pairs]
                    counts["duplicates"] += len(kept) - len(new)
                    for c, r in new:
                        seen_pairs.add((key_prompt, _SPACES.sub(" ", c)))
                        rows.append(sft_row(problems[i], c, r))
                    totals["prompts_without_keep"] += not new
                    if cfg.pairs:
                        pair = best_and_worst(texts[sl], total[sl], finish[sl], min_reward=cfg.min_reward,
                                              margin=cfg.pair_margin)
                        totals["prompts_without_pair"] += not add_pair(pair_rows, seen_prefs, problems[i], key_prompt, pair)
                    for k, v in counts.items():
                        totals[k] += v
                judged = [t for t in total if t is not None]
                samples += len(texts)
                passes += sum(t >= cfg.min_reward for t in judged)
                last = {**batch.metrics, "rs/accept_rate": sum(t >= cfg.min_reward for t in judged) / len(texts),
                        "rs/kept": float(len(rows) - kept_before), **({"rs/pairs": float(len(pair_rows))} if cfg.pairs else {})}
                if step < n_steps:
                    ctx.log(stage, step, last)  # a replayed batch logs again: the resume dropped the killed run's rows
                bar.update(task, completed=step, info=f"kept {len(rows):,}")
    finally:
        journal.close()
        close_rewards(verifiers)

    # ---- save ----------------------------------------------------------------------------------
    index = recipe_eval_index(ctx) if "decontaminate" in cfg.gates else None
    rows, gated = gate_rows(rows, "sft", cfg.gates, index, str(out_path))
    pair_rows, pairs_gated = gate_rows(pair_rows, "preference", cfg.gates if cfg.pairs else [], index, str(pairs_out))
    for r in gated + pairs_gated:
        ctx.console.print(f"{stage}: gate {r.summary()}")
    if not rows:
        raise ValueError(f"{stage}: no sample reached min_reward={cfg.min_reward} on {len(problems)} prompts × "
                         f"{cfg.samples} samples" + (f" and passed the gates {cfg.gates}" if cfg.gates else "")
                         + "; nothing to write (lower min_reward or raise samples)")
    if pairs_out is not None and not pair_rows:
        raise ValueError(f"{stage}: no preference pair on {len(problems)} prompts × {cfg.samples} samples (no prompt had a "
                         f"sample ≥ min_reward={cfg.min_reward} and a finished one more than pair_margin={cfg.pair_margin} "
                         f"below it); nothing to write (raise samples or temperature, or lower pair_margin)")
    write_jsonl(out_path, rows)
    read_jsonl(out_path, "sft")  # the hand-off contract: what we wrote reads back as SFT data
    if pairs_out is not None:
        write_jsonl(pairs_out, pair_rows)
        read_jsonl(pairs_out, "preference")  # and the pairs as preference data
    summary = {"rs/rows": float(len(rows)), "rs/accept_rate": passes / samples, "rs/prompts": float(len(problems)),
               "rs/batches_replayed": float(len(journaled)), "rs/batches_judged": float(n_steps - len(journaled)),
               **({"rs/pairs": float(len(pair_rows))} if cfg.pairs else {}),
               **{f"rs/{k}": float(v) for k, v in totals.items()},
               **gate_metrics(gated), **gate_metrics(pairs_gated, "pairs."),
               **(pooled(batch_metrics) if cfg.judge is not None else {})}
    ctx.log(stage, n_steps, {**last, **summary})
    ctx.console.print(f"{stage}: wrote {len(rows):,} SFT rows to {out_path} (accept rate {passes / samples:.1%}; "
                      f"{totals['prompts_without_keep']} prompts without a kept sample, {totals['duplicates']} duplicates)")
    data = {"output": str(out_path), "rows": len(rows)}
    if pairs_out is not None:
        ctx.console.print(f"{stage}: wrote {len(pair_rows):,} preference pairs to {pairs_out} "
                          f"({totals['prompts_without_pair']} prompts without a pair)")
        data.update(pairs_output=str(pairs_out), pairs=len(pair_rows))
    if "judge/agreement_with_gold" in summary:
        ctx.console.print(f"{stage}: judge vs the gold judge: agreement {summary['judge/agreement_with_gold']:.3f} ± "
                          f"{summary['judge/agreement_se']:.3f} on {summary['judge/agreement_n']:.0f} pairs the gold separates "
                          f"(ties {summary['judge/ties']:.0f}, unparseable {summary['judge/unparseable']:.0f}); "
                          f"{summary['judge/requests']:.0f} judge requests")
    if journaled:
        ctx.console.print(f"{stage}: {len(journaled)} of {n_steps} batches replayed from {jpath} "
                          f"(not generated, not judged again); {n_steps - len(journaled)} judged now")
    state = {"stage": stage, "step": n_steps, "data": data,
             **({"teacher": str(gen_path)} if teacher is not None else {})}
    # final/ holds the current policy: the sampler itself, or — with a teacher — the student, loaded only now
    student = model if teacher is None and model is not None else ctx.load_model(policy)
    final = save_checkpoint(ctx.stage_dir(stage), student, ctx.tokenizer, state, keep_last=1, final=True)
    return StageResult(final, summary)
