"""Distillation as a collect source (rejection_sampling's `teacher:`) and the collect step's journal."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from posttrain.pipeline.run import RunError, run_pipeline
from posttrain.runtime.checkpoint import load_state
from posttrain.runtime.config import Recipe, RejectionSamplingStage
from posttrain.stages._collect_journal import Journal, JudgedBatch, fingerprint, read_journal
from posttrain.stages.rejection_sampling import check_teachers, output_path, run_rejection_sampling
from conftest import make_ctx, tiny_recipe_dict


# ---- the journal ---------------------------------------------------------------------------------
def _batch(step: int) -> JudgedBatch:
    return JudgedBatch(step, [f"{step}", "x"], ["stop", "length"], [1.0, None], {"reward/total": 0.5})


def test_journal_round_trips_and_drops_a_torn_last_line(tmp_path):
    path, fp = tmp_path / "j.jsonl", fingerprint("{}", [[1, 2], [3]])
    j = Journal(path, "rs", fp, keep=0)
    for k in (1, 2, 3):
        j.append(_batch(k))
    j.close()
    whole = path.read_bytes()
    assert read_journal(path, fp)[0] == [_batch(1), _batch(2), _batch(3)]  # None survives as null → None
    # a kill -9 in the middle of batch 4's write: half a line, no newline
    with path.open("ab") as f:
        f.write(b'{"step": 4, "texts": ["4", "x"], "fin')
    batches, note = read_journal(path, fp)
    assert batches == [_batch(1), _batch(2), _batch(3)] and "dropped 1 torn" in note
    # reopening after the 3 kept batches cuts the torn tail away, byte for byte, then appends after it
    j = Journal(path, "rs", fp, keep=3)
    assert path.read_bytes() == whole
    j.append(_batch(4))
    j.close()
    assert read_journal(path, fp)[0] == [_batch(k) for k in (1, 2, 3, 4)]


def test_journal_of_another_config_or_out_of_order_is_not_trusted(tmp_path):
    path, fp = tmp_path / "j.jsonl", fingerprint("{}", [[1]])
    j = Journal(path, "rs", fp, keep=0)
    j.append(_batch(1))
    j.append(_batch(3))  # step 2 missing: only batch 1 can be trusted
    j.close()
    assert read_journal(path, fp)[0] == [_batch(1)]
    batches, note = read_journal(path, fingerprint('{"samples": 2}', [[1]]))  # another config
    assert batches == [] and "another config" in note
    assert read_journal(tmp_path / "none.jsonl", fp) == ([], None)


# ---- the teacher ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def student_dir(tmp_path_factory, tokenizer):
    """Another tiny model (other seed, half the layers): the student whose checkpoint the stage keeps."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("student")
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=1, max_seq_len=160,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _rs(tmp_path, name, start, tokenizer, world, **over):
    cfg = RejectionSamplingStage(name=name, samples=8, batch_prompts=8, max_new_tokens=32, min_reward=-1e9,
                                 keep="all_correct", rewards=[{"name": "length", "params": {"max_len": 64, "count": "chars"}}],
                                 data=[{"task": "arithmetic", "n": 16}], **over)
    ctx, sink = make_ctx(tmp_path, start, tokenizer, world, cfg)
    result = run_rejection_sampling(cfg, ctx)
    return output_path(cfg, tmp_path).read_bytes(), result, sink


def test_a_teacher_generates_and_the_student_is_kept(tmp_path, policy_dir, student_dir, tokenizer, world):
    # The same seeded samples: a stage whose teacher is `policy_dir`, started from the student, writes the
    # bytes a stage sampling `policy_dir` itself writes — the teacher generated them, not the student.
    from_teacher, res, _ = _rs(tmp_path, "distill", student_dir, tokenizer, world, teacher=str(policy_dir))
    own, _, _ = _rs(tmp_path, "own", policy_dir, tokenizer, world)
    from_student, _, _ = _rs(tmp_path, "student", student_dir, tokenizer, world)
    assert from_teacher == own and from_teacher != from_student
    # its checkpoint is the student's (the current policy), unchanged
    kept, student = load_file(res.checkpoint / "model.safetensors"), load_file(student_dir / "model.safetensors")
    assert kept.keys() == student.keys() and all(bool((kept[k] == student[k]).all()) for k in kept)
    assert load_state(res.checkpoint)["teacher"] == str(policy_dir)  # recorded beside the data's path


def test_a_teacher_that_is_no_stage_and_no_model_is_an_error_naming_the_field(tmp_path, policy_dir):
    def recipe(teacher: str, first: bool = False) -> Recipe:
        rs = {"stage": "rejection_sampling", "data": [{"task": "arithmetic", "n": 8}], "teacher": teacher}
        sft = {"stage": "sft", "name": "teach", "steps": 1, "data": [{"task": "arithmetic", "n": 8}]}
        return Recipe.model_validate({"stages": [rs, sft] if first else [sft, rs]})

    check_teachers(recipe("teach"))  # an earlier stage of the run
    check_teachers(recipe(str(policy_dir)))  # a model folder
    with pytest.raises(ValueError, match=r"stages\[0\]\.teacher: 'teach' is stages\[1\], which runs later"):
        check_teachers(recipe("teach", first=True))
    with pytest.raises(ValueError, match=r"stages\[1\]\.teacher: 'gpro' is neither a stage of this run"):
        check_teachers(recipe("gpro"))
    (tmp_path / "weights").mkdir()
    with pytest.raises(ValueError, match=r"stages\[1\]\.teacher: .* nor a model folder with a config.json"):
        check_teachers(recipe(str(tmp_path / "weights")))
    # through the pipeline: refused before anything is written
    d = tiny_recipe_dict(threads=1, evals=[])
    d["stages"] = d["stages"][:1] + [{"stage": "rejection_sampling", "data": [{"task": "arithmetic", "n": 8}],
                                      "teacher": "nowhere"}]
    with pytest.raises(RunError, match=r"stages\[1\]\.teacher: 'nowhere'"):
        run_pipeline(Recipe.model_validate(d), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---- quality gates on what a collect step keeps ----------------------------------------------------
def test_gates_drop_kept_rows_that_are_eval_problems_and_count_them(tmp_path, policy_dir, tokenizer, world):
    import json

    from posttrain.runtime.config import Recipe as R
    from posttrain.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(world=world)
    evals = task.eval_problems("L1")[:4]  # planted: 4 held-out eval problems among 4 training ones
    mixed = evals + task.records("problem", 4, seed_offset=7, levels=["L1"])
    src = tmp_path / "problems.jsonl"
    src.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer, "level": p.level}) + "\n" for p in mixed))

    def run(name: str, gates: list[str]):
        cfg = RejectionSamplingStage(name=name, samples=8, batch_prompts=8, max_new_tokens=32, min_reward=-1e9,
                                     keep="all_correct", rewards=[{"name": "length", "params": {"max_len": 64, "count": "chars"}}],
                                     data=[{"path": str(src)}], gates=gates)
        ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
        ctx.recipe = R(stages=[cfg], threads=1, evals=[{"task": "arithmetic", "levels": ["L1"], "per_level": 8}])
        run_rejection_sampling(cfg, ctx)
        rows = [json.loads(x) for x in output_path(cfg, tmp_path).read_text().splitlines()]
        return rows, [r for r in sink.records if "rs/rows" in r][-1]

    plain, _ = run("plain", [])
    gated, m = run("gated", ["exact_dedup", "decontaminate"])
    eval_prompts = {p.prompt for p in evals}
    planted = [r for r in plain if r["messages"][-2]["content"] in eval_prompts]
    assert planted, "no kept row for a planted eval problem: the test would prove nothing"
    # the same seeded samples; the gated file is the plain one without the rows of eval problems
    assert gated == [r for r in plain if r not in planted]
    assert m["gate/exact_dedup/seen"] == m["gate/exact_dedup/kept"] == len(plain)  # the stage already deduplicated
    assert m["gate/decontaminate/removed/eval overlap"] == len(planted) and m["rs/rows"] == len(gated)


def test_a_teacher_with_another_tokenizer_generates_text_the_student_reads(tmp_path, policy_dir, tokenizer, world):
    import json

    from posttrain.data import encode_sft_dataset, read_jsonl
    from posttrain.models import build_tiny, train_tokenizer
    from conftest import make_reward_model

    # a teacher with its own, smaller vocabulary (trained on less text, 300 tokens): ids mean other things
    texts = list(world.pretrain_documents(200)) + [f"user\n{ex[0]['content']}\nassistant\n{ex[1]['content']}"
                                                   for ex in world.sft_split(100)]
    other = train_tokenizer(texts, vocab_size=300)
    assert other.get_vocab() != tokenizer.get_vocab()
    teacher = tmp_path / "teacher"
    build_tiny("tiny-1m", vocab_size=len(other), seed=2, max_seq_len=160, pad_token_id=other.pad_token_id,
               eos_token_id=other.eos_token_id).save_pretrained(teacher)
    other.save_pretrained(teacher)
    data, _, _ = _rs(tmp_path, "distill", policy_dir, tokenizer, world, teacher=str(teacher))
    rows = [json.loads(x) for x in data.decode().splitlines()]
    assert rows and all(r["messages"][0]["role"] == "user" for r in rows)
    # the kept text is re-tokenized by the student's tokenizer: it reads and encodes as SFT data
    records = read_jsonl(tmp_path / "data" / "distill.jsonl", "sft").records
    encoded, _ = encode_sft_dataset(records, tokenizer, 160, truncation="error")
    assert len(encoded) == len(rows)
    # a reward model scores the run's token ids: refused with a teacher of another vocabulary
    rm = make_reward_model(tmp_path / "rm", policy_dir)
    with pytest.raises(ValueError, match="has another tokenizer than the run's"):
        _rs(tmp_path, "rm", policy_dir, tokenizer, world, teacher=str(teacher), reward_model=str(rm))
