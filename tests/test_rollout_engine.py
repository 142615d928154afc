"""The RolloutEngine protocol: every backend implements all of it, and no stage reaches past it."""

import inspect
import random
import re
from pathlib import Path

import pytest
import torch

import posttrain
from posttrain.models import build_tiny, train_tokenizer
from posttrain.pipeline.run import RunError, check_backends
from posttrain.rollout import HFEngine, NativeEngine, RolloutEngine, SamplingParams
from posttrain.rollout.engine import backend_unavailable_reason
from posttrain.rollout.vllm_backend import VLLMEngine
from posttrain.runtime.config import Recipe
from posttrain.telemetry import costs

PROTOCOL_METHODS = ("generate", "update_weights", "sync_weights", "decode_cost")
PROTOCOL_FIELDS = ("name", "pad_id", "eos_ids")


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    return train_tokenizer([f"{rng.randint(0, 99)} + {rng.randint(0, 99)}" for _ in range(200)], vocab_size=300)


@pytest.fixture(scope="module")
def tiny(tok):
    return build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id).eval()


def test_the_protocol_declares_what_the_stages_call():
    declared = {n for n in dir(RolloutEngine) if not n.startswith("_")} | set(RolloutEngine.__annotations__)
    assert declared >= set(PROTOCOL_METHODS + PROTOCOL_FIELDS)


@pytest.mark.parametrize("engine_cls", [NativeEngine, HFEngine])
def test_cpu_backends_satisfy_the_protocol_and_cost_a_decode(engine_cls, tok, tiny):
    e = engine_cls(tiny, tok)
    assert isinstance(e, RolloutEngine)
    assert e.pad_id == tok.pad_token_id and tok.eos_token_id in e.eos_ids
    # the cost is the telemetry's analytic decode cost of the engine's model: 2 prompts × 5 tokens, 3 new
    want = costs.decode(tiny.config, batch=2, prompt_len=5, new_tokens=3)
    got = e.decode_cost(batch=2, prompt_len=5, new_tokens=3)
    assert (got.flops, got.bytes) == (want.flops, want.bytes) and got.flops > 0
    # 2 prompts × 3 samples: the native engine prefills each prompt once and, where its samples share the
    # prompt's cache (the C attention), reads its keys once a step; `generate` prefills every copy
    shared = engine_cls is NativeEngine and e.step.gathers_rows(torch.device("cpu"))
    want = costs.decode(tiny.config, batch=6, prompt_len=5, new_tokens=3,
                        **({"samples": 3, "shared_reads": shared} if engine_cls is NativeEngine else {}))
    got = e.decode_cost(batch=6, prompt_len=5, new_tokens=3, samples=3)
    assert (got.flops, got.bytes) == (want.flops, want.bytes)
    alone = costs.decode(tiny.config, batch=6, prompt_len=5, new_tokens=3)
    assert (got.bytes < alone.bytes) == (engine_cls is NativeEngine)
    r = e.generate([[5, 6, 7]], SamplingParams(n=1, max_new_tokens=2, temperature=0.0))
    assert r.completion_ids.shape == (1, r.completion_ids.shape[1])


def test_the_vllm_backend_implements_the_whole_protocol():
    # it cannot be built without a GPU; its class still defines every method, and its constructor
    # sets every field (read from the source: a field missing there would fail a stage on the GPU)
    for m in PROTOCOL_METHODS:
        assert callable(getattr(VLLMEngine, m, None)), m
    init = inspect.getsource(VLLMEngine.__init__) + inspect.getsource(VLLMEngine._setup)  # __init__ calls _setup
    assert "self._setup(" in inspect.getsource(VLLMEngine.__init__)
    assert VLLMEngine.name == "vllm"
    for field in ("pad_id", "eos_ids", "config"):
        assert re.search(rf"self\.{field}\s*=", init), field


def test_no_library_code_reaches_through_an_engine_to_its_model():
    root = Path(posttrain.__file__).parent
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if "rollout" not in p.parts
                 for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"engine\.model\b", line)]
    assert offenders == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_a_recipe_naming_vllm_fails_before_the_run_in_one_line():
    recipe = Recipe.model_validate({"name": "v", "model": {"init": "tiny-1m"},
                                    "stages": [{"stage": "sft", "steps": 1, "data": [{"task": "arithmetic", "n": 8}]},
                                               {"stage": "grpo", "steps": 1, "backend": "vllm",
                                                "data": [{"task": "arithmetic", "n": 8}]}]})
    assert recipe.stages[1].backend == "vllm"                     # the recipe accepts it
    assert backend_unavailable_reason("native") is None
    with pytest.raises(RunError, match=r"^stages\[1\]\.backend: 'vllm', but the vLLM backend needs") as e:
        check_backends(recipe)
    assert "\n" not in str(e.value)
