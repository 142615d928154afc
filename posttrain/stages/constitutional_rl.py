"""RL-CAI's labelling: pairs of the policy's own samples judged against a sampled principle; the
decided pairs become preference data for a following `dpo` (or `reward_model` + `ppo`) stage.

Reference: Bai et al. 2022, "Constitutional AI", §4.1: sample two responses per prompt from the SL-CAI
model, ask a feedback model which better follows a principle sampled from the constitution (as a
multiple-choice question), train a preference model on those labels, then RL against it (§4.2).

What it writes (docs/constitutional_ai.md):
- `output` (default `<run dir>/data/<name>.jsonl`): preference rows `{prompt, chosen, rejected,
  principle, level, answer}` for every pair the feedback model decided;
- `records_output`: one row per judged pair — both replies, the principle, the winner (first, second,
  tie, null = unparseable), the judge's raw replies, and the rule checker's verdict on each reply;
- `checkpoints/<name>/final/`: the unchanged policy.
Logged: the feedback model's agreement with the rule checker (the gold) on the pairs the checker
separates, ± its binomial standard error (`cai/agreement`, `cai/agreement_se`, `cai/agreement_n`).

Departures (numbered):
1. Hard labels: a pair is judged in both orders (judges/pairwise.py) and kept only when both orders
   agree; the paper trains its preference model on the feedback model's soft probabilities.
2. DPO instead of a preference model + PPO by default: the following stage names the file; a
   `reward_model` stage reads the same `preference` schema, so the paper's PM + RL path is a recipe
   edit, not code.
3. Pairs are consecutive samples of a prompt ((1, 2), (3, 4), …); a pair with a truncated or empty
   reply, or two replies equal up to whitespace, is not judged (counted: `cai/pairs_skipped`).
"""

from __future__ import annotations

import json
import re

from posttrain.data import prompt_messages, read_jsonl
from posttrain.judges import Principle, Winner, gold_agreement, gold_of_pair
from posttrain.rollout import SamplingParams
from posttrain.runtime.checkpoint import save_checkpoint
from posttrain.runtime.config import ConstitutionalRLStage
from posttrain.runtime.context import RunContext, StageResult
from posttrain.stages._constitution import (
    compliance,
    compliance_rates,
    make_labeler,
    setup,
)
from posttrain.stages.rejection_sampling import write_jsonl

SEED_OFFSET = 3_000  # world problems distinct from GRPO's, rejection sampling's and SL-CAI's
_SPACES = re.compile(r"\s+")


def usable_pair(x: str, y: str, fx: str, fy: str) -> bool:
    """Both replies ended their turn, are non-empty, and differ beyond whitespace."""
    return fx == fy == "stop" and bool(x.strip()) and bool(y.strip()) and _SPACES.sub(" ", x.strip()) != _SPACES.sub(" ", y.strip())


def run_constitutional_rl(cfg: ConstitutionalRLStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    stage, tok = cfg.folder, ctx.tokenizer
    su = setup(cfg, ctx, cfg.judge, seed_offset=SEED_OFFSET)
    constitution, problems, prompts, model, engine = su.constitution, su.problems, su.prompts, su.model, su.engine
    rng, out_path, rec_path = su.rng, su.out_path, su.rec_path
    labeler = make_labeler(cfg.judge, ctx, model, engine)
    ctx.console.print(f"{stage}: {len(problems):,} prompts × {cfg.samples} samples at T={cfg.temperature} → {cfg.samples // 2} "
                      f"pair(s) each, labelled by the {cfg.judge.kind} judge against a principle sampled from "
                      f"{constitution.source} → {out_path} (records: {rec_path})")

    # ---- loop ----------------------------------------------------------------------------------
    rows: list[dict] = []
    records: list[dict] = []
    judgements, gold_1, gold_2, verdicts = [], [], [], []
    skipped = 0
    n_steps = -(-len(problems) // cfg.batch_prompts)
    with ctx.progress() as bar:
        task = bar.add_task(stage, total=n_steps, completed=0, info="")
        for step, start in enumerate(range(0, len(problems), cfg.batch_prompts), 1):
            batch = problems[start:start + cfg.batch_prompts]
            params = SamplingParams(n=cfg.samples, temperature=cfg.temperature, top_p=cfg.top_p,
                                    max_new_tokens=cfg.max_new_tokens, seed=ctx.recipe.seed * 1_000_003 + 10_007 * cfg.draw + step)
            with ctx.phase("generate", stage=stage, step=step) as p:
                ro = engine.generate(prompts[start:start + len(batch)], params)
                p.cost = engine.decode_cost(batch=len(ro), prompt_len=ro.prompt_ids.shape[1],
                                            new_tokens=max(1, ro.completion_ids.shape[1]), samples=params.n)
            texts = [t.strip() for t in ro.texts]
            verdicts += [compliance(constitution, batch[k // cfg.samples], t) for k, t in enumerate(texts)]
            pairs: list[tuple[int, str, str, Principle]] = []  # (problem index in batch, first, second, principle)
            for j in range(len(batch)):
                for k in range(j * cfg.samples, (j + 1) * cfg.samples, 2):
                    if usable_pair(texts[k], texts[k + 1], ro.finish_reason[k], ro.finish_reason[k + 1]):
                        pairs.append((j, texts[k], texts[k + 1], constitution.sample(rng)))
                    else:
                        skipped += 1
            with ctx.phase("score", stage=stage, step=step):  # the feedback model's work
                got = labeler.label([batch[j] for j, *_ in pairs], [x for _, x, _, _ in pairs], [y for *_, y, _ in pairs],
                                    [p for *_, p in pairs]) if pairs else []
            for (j, x, y, principle), judged in zip(pairs, got):
                g1, g2 = gold_of_pair(principle, batch[j], x, y)
                judgements.append(judged)
                gold_1.append(g1)
                gold_2.append(g2)
                prompt = [m.as_dict() for m in prompt_messages(batch[j].prompt)]
                winner = None if judged.winner is None else judged.winner.value
                records.append({"prompt": prompt, "first": x, "second": y, "principle": principle.name, "winner": winner,
                                "choices": list(judged.choices), "judge_replies": list(judged.replies),
                                "gold_first": g1, "gold_second": g2, "level": batch[j].level, "answer": batch[j].answer})
                if judged.winner in (Winner.FIRST, Winner.SECOND):
                    chosen, rejected = (x, y) if judged.winner is Winner.FIRST else (y, x)
                    rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "principle": principle.name,
                                 "level": batch[j].level, "answer": batch[j].answer})
            last = {"cai/pairs": float(len(records)), "cai/rows": float(len(rows))}
            if step < n_steps:
                ctx.log(stage, step, last)
            bar.update(task, completed=step, info=f"pairs {len(rows):,}")

    # ---- save ----------------------------------------------------------------------------------
    write_jsonl(rec_path, records)
    agreement = gold_agreement(judgements, gold_1, gold_2)
    summary = {**last, "cai/pairs_skipped": float(skipped), "cai/agreement": agreement.rate, "cai/agreement_se": agreement.se,
               "cai/agreement_n": float(agreement.n), "cai/ties": float(agreement.ties),
               "cai/unparseable": float(agreement.unparseable),
               **({} if agreement.decided_rate is None else {"cai/agreement_decided": agreement.decided_rate}),
               **compliance_rates(verdicts, "cai/comply_samples")}
    ctx.log(stage, n_steps, summary)  # the judge's agreement is evidence even when it decided nothing
    if not rows:
        raise ValueError(f"{stage}: the judge decided none of {len(records)} pairs ({skipped} skipped; records in {rec_path}; "
                         f"{agreement.summary()}); nothing to train on (raise samples or temperature, or use another judge)")
    write_jsonl(out_path, rows)
    read_jsonl(out_path, "preference")  # the hand-off contract
    ctx.console.print(f"{stage}: {len(rows):,} preference rows → {out_path} from {len(records)} judged pairs ({skipped} skipped); "
                      f"judge vs the rule checker: {agreement.summary()}")
    state = {"stage": stage, "step": n_steps, "data": {"output": str(out_path), "records": str(rec_path), "rows": len(rows),
                                                      "agreement": json.loads(json.dumps(agreement.__dict__, default=list))}}
    final_ckpt = save_checkpoint(ctx.stage_dir(stage), model, tok, state, keep_last=1, final=True)
    return StageResult(final_ckpt, summary)
