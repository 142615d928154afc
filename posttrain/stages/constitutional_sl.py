"""SL-CAI: the policy's responses critiqued and revised against sampled principles; the revisions
become SFT data for a following `sft` stage.

Reference: Bai et al. 2022, "Constitutional AI: Harmlessness from AI Feedback", §3.1: sample a
response to each prompt, show the model its response with a critique request drawn from a sampled
principle, then a revision request; repeat with further sampled principles; fine-tune the pretrained
model on the final revisions (§3.2).

What it writes (docs/constitutional_ai.md):
- `records_output` (default `<run dir>/data/<name>.records.jsonl`): one auditable row per response —
  the prompt, the sampled response and its finish reason, every pass's (principle, critique,
  revision), the final revision, and each checked principle's verdict on the response and on the
  final revision;
- `output` (default `<run dir>/data/<name>.jsonl`): the SFT rows (prompt turns + the final revision
  as the assistant turn), read back as `sft` data before the stage ends;
- `checkpoints/<name>/final/`: the unchanged policy (as rejection_sampling's), so the pipeline can
  treat it like any stage; the following `sft` stage names `output` as its data.

Departures (numbered):
1. The feedback model is chosen by the recipe (`reviser`): the policy itself (`local`, `checkpoint:
   policy` — the paper's self-critique), another chat model, an endpoint, or `rule`: the principle's
   checker and its rule reviser. The arithmetic world's tiny policy cannot follow a critique request,
   so its recipe uses `rule` — a demonstration of the data path, not of self-critique.
2. The paper fine-tunes the *pretrained* model on the revisions; the following `sft` stage here
   starts from this stage's start (the SFT policy), as a pipeline stage does. Their paper's
   helpful-only RLHF model is our SFT model's counterpart.
3. A revision a reviser cannot produce (empty, or a rule that cannot fix the reply) keeps the
   previous text for the next pass; a response whose final text was never usably revised is not
   written to the SFT data (counted: `cai/unusable`). `keep: changed` also drops unchanged revisions.
4. No step checkpoints: a killed stage re-runs from the start (sampling and principles are seeded).
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.data import prompt_messages, read_jsonl
from posttrain.judges import Principle
from posttrain.rollout import SamplingParams
from posttrain.runtime.checkpoint import save_checkpoint
from posttrain.runtime.config import ConstitutionalSLStage
from posttrain.runtime.context import RunContext, StageResult
from posttrain.stages._constitution import (
    compliance,
    compliance_rates,
    make_reviser,
    setup,
)
from posttrain.stages.rejection_sampling import write_jsonl
from posttrain.telemetry import costs

SEED_OFFSET = 2_000  # world problems distinct from GRPO's (0) and rejection sampling's (1,000)


def run_constitutional_sl(cfg: ConstitutionalSLStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    stage, tok = cfg.folder, ctx.tokenizer
    su = setup(cfg, ctx, cfg.reviser, seed_offset=SEED_OFFSET)
    constitution, problems, prompts, model, engine = su.constitution, su.problems, su.prompts, su.model, su.engine
    rng, out_path, rec_path = su.rng, su.out_path, su.rec_path
    reviser = make_reviser(cfg.reviser, ctx, model, engine)
    ctx.console.print(f"{stage}: {len(problems):,} prompts, 1 response each at T={cfg.temperature}; {cfg.revisions} critique → "
                      f"revision pass(es) by the {cfg.reviser.kind} reviser against {len(constitution.principles)} principles "
                      f"of {constitution.source} → {out_path} (records: {rec_path})")

    # ---- loop ----------------------------------------------------------------------------------
    rows: list[dict] = []
    records: list[dict] = []
    before, after = [], []
    changed = unusable = 0
    n_steps = -(-len(problems) // cfg.batch_prompts)
    with ctx.progress() as bar:
        task = bar.add_task(stage, total=n_steps, completed=0, info="")
        for step, start in enumerate(range(0, len(problems), cfg.batch_prompts), 1):
            batch = problems[start:start + cfg.batch_prompts]
            params = SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                    seed=ctx.recipe.seed * 1_000_003 + 10_007 * cfg.draw + step)
            with ctx.phase("generate", stage=stage, step=step) as p:
                ro = engine.generate(prompts[start:start + len(batch)], params)
                p.cost = costs.decode(model.config, batch=len(ro), prompt_len=ro.prompt_ids.shape[1],
                                      new_tokens=max(1, ro.completion_ids.shape[1]))
            current = [t.strip() for t in ro.texts]
            usable = [False] * len(batch)
            passes: list[list[dict]] = [[] for _ in batch]
            for _ in range(cfg.revisions):
                principles: list[Principle] = [constitution.sample(rng) for _ in batch]
                with ctx.phase("score", stage=stage, step=step):  # the feedback model's work (a local model generates)
                    revs = reviser.revise(batch, current, principles)
                for j, (p, r) in enumerate(zip(principles, revs)):
                    passes[j].append({"principle": p.name, "critique": r.critique, "revision": r.revision})
                    if r.revision:
                        current[j], usable[j] = r.revision, True
            for j, problem in enumerate(batch):
                response, final = ro.texts[j].strip(), current[j]
                b, a = compliance(constitution, problem, response), compliance(constitution, problem, final)
                before.append(b)
                after.append(a)
                changed += final != response
                messages = [m.as_dict() for m in prompt_messages(problem.prompt)]
                records.append({"prompt": messages, "response": response, "finish": ro.finish_reason[j], "passes": passes[j],
                                "final": final if usable[j] else None, "compliance_before": b, "compliance_after": a,
                                "level": problem.level, "answer": problem.answer})
                if not usable[j] or not final:
                    unusable += 1
                    continue
                if cfg.keep == "changed" and final == response:
                    continue
                rows.append({"messages": messages + [{"role": "assistant", "content": final}], "level": problem.level,
                             "answer": problem.answer})
            last = {**compliance_rates(before, "cai/comply_before"), **compliance_rates(after, "cai/comply_after"),
                    "cai/rows": float(len(rows))}
            if step < n_steps:
                ctx.log(stage, step, last)
            bar.update(task, completed=step, info=f"rows {len(rows):,}")

    # ---- save ----------------------------------------------------------------------------------
    write_jsonl(rec_path, records)  # the audit trail, even when no row is usable
    if not rows:
        raise ValueError(f"{stage}: no usable revision of {len(problems)} responses (records in {rec_path}); nothing to train on")
    write_jsonl(out_path, rows)
    read_jsonl(out_path, "sft")  # the hand-off contract: what we wrote reads back as SFT data
    summary = {**last, "cai/responses": float(len(records)), "cai/changed": float(changed), "cai/unusable": float(unusable)}
    ctx.log(stage, n_steps, summary)
    ctx.console.print(f"{stage}: {len(rows):,} SFT rows → {out_path}; {changed} of {len(records)} responses changed by revision, "
                      f"{unusable} without a usable revision; rule-checked compliance "
                      f"{summary.get('cai/comply_before/all', float('nan')):.1%} → {summary.get('cai/comply_after/all', float('nan')):.1%}")
    state = {"stage": stage, "step": n_steps, "data": {"output": str(out_path), "records": str(rec_path), "rows": len(rows)}}
    final_ckpt = save_checkpoint(ctx.stage_dir(stage), model, tok, state, keep_last=1, final=True)
    return StageResult(final_ckpt, summary)


def read_records(path: Path) -> list[dict]:
    """The stage's audit records, one dict per response."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
