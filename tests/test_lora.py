"""LoRA via PEFT (posttrain.models.lora) on tiny models: the merge by hand, the reference with adapters
disabled, the fused decode path on merged weights, PEFT's checkpoint format, `export --merge`, and a
smoke run of every stage kind (every adapter parameter changed, base weights unchanged, the stage's
metric moved the right way)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from posttrain.models import load_model, lora
from posttrain.models.heads import load_scalar_model, token_scores
from posttrain.rewards import WeightedVerifier
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.cpu.fused import FusedWeights, fused_unsupported_reason
from posttrain.runtime.config import DPOStage, GRPOStage, PPOStage, PretrainStage, Recipe, RewardModelStage, SFTStage
from posttrain.runtime.context import RunContext
from posttrain.stages import _training, grpo as grpo_mod
from posttrain.stages.dpo import run_dpo
from posttrain.stages.grpo import run_grpo
from posttrain.stages.ppo import run_ppo
from posttrain.stages.pretrain import run_pretrain
from posttrain.stages.reward_model import run_reward_model
from posttrain.stages.sft import run_sft
from posttrain.telemetry import Telemetry
from conftest import ListSink, make_reward_model, world_tasks

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def wrapped(policy_dir: Path, **over) -> torch.nn.Module:
    torch.manual_seed(0)
    model = load_model(policy_dir)
    return lora.wrap(model, **{**LORA, "target_modules": ALL, **over}, base=policy_dir)


def randomize_adapters(model: torch.nn.Module, std: float = 0.05) -> None:
    """B starts at zero (the adapted model is the base exactly); give it a value so adapters matter."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora.adapter_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


# ---- the merge, by hand ----------------------------------------------------------------------------
def test_merged_weight_by_hand():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2, bias=False)

    m = Tiny()
    with torch.no_grad():
        m.proj.weight.copy_(torch.eye(2))
    lora.wrap(m, r=1, alpha=2.0, dropout=0.0, target_modules=["proj"])
    layer = m.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.tensor([[1.0, 2.0]]))    # (r, in)
        layer.lora_B["default"].weight.copy_(torch.tensor([[1.0], [0.0]]))  # (out, r)
    # scale α/r = 2/1 = 2; B·A = [[1, 2], [0, 0]] → W₀ + 2·B·A = [[3, 4], [0, 1]]
    expected = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    buf = torch.empty(2, 2)
    out = lora.merged_weight(layer, out=buf)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # the layer's own forward (unmerged): x = [1, 1] → W₀x + 2·B(Ax) = [1, 1] + 2·[3, 0] = [7, 1]
    with torch.no_grad():
        torch.testing.assert_close(m.proj(torch.ones(1, 2)), torch.tensor([[7.0, 1.0]]))
        with lora.adapters_disabled(m):  # W₀ only
            torch.testing.assert_close(m.proj(torch.ones(1, 2)), torch.tensor([[1.0, 1.0]]))
            assert lora.merged_weight(layer).data_ptr() == layer.weight.data_ptr()  # no adapter acts: W₀ itself


def test_wrap_names_a_missing_target(policy_dir):
    with pytest.raises(lora.LoraError, match=r"\['qkv'\] name no Linear or Embedding layer"):
        wrapped(policy_dir, target_modules=["q_proj", "qkv"])


def test_trainable_count_is_the_adapter_arithmetic(policy_dir):
    model = wrapped(policy_dir, target_modules=["q_proj", "v_proj"])
    cfg = model.config
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    # per layer r·(in + out): q (h → h) and v (h → kv) = 4·(2h) + 4·(h + kv)
    expected = layers * (4 * 2 * h + 4 * (h + kv))
    trainable, total = lora.trainable_parameters(model)
    assert trainable == expected
    assert total == sum(p.numel() for p in load_model(policy_dir).parameters()) + expected


# ---- the reference: the same weights with adapters disabled -----------------------------------------
def test_reference_with_adapters_disabled_is_the_base_model(policy_dir):
    model = wrapped(policy_dir)
    randomize_adapters(model)
    base = load_model(policy_dir).eval()
    ids = torch.randint(3, 300, (3, 17), generator=torch.Generator().manual_seed(0))
    ref = _training.ReferencePolicy(model, shared=True)
    model.train()
    with ref() as m:
        assert not m.training  # eval inside: dropout off
        logits = m(input_ids=ids).logits
    assert model.training  # restored
    with torch.no_grad():
        torch.testing.assert_close(logits, base(input_ids=ids).logits, rtol=0, atol=1e-6)
        assert (model(input_ids=ids).logits - logits).abs().max() > 1e-2  # the adapters do act outside


def test_merged_copy_is_plain_and_leaves_the_adapters(policy_dir):
    model = wrapped(policy_dir)
    randomize_adapters(model)
    plain = lora.merged_copy(model)
    assert not lora.is_lora(plain) and lora.is_lora(model)
    assert not any(".lora_" in n for n, _ in plain.named_parameters())
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert lora.active_adapters(model.model.layers[0].self_attn.q_proj) == ["default"]  # still unmerged, still acting


# ---- the rollout engine on merged weights -----------------------------------------------------------
def test_fused_decode_runs_on_the_merged_weights(policy_dir, tokenizer):
    model = wrapped(policy_dir, target_modules=ALL + ["lm_head"])
    randomize_adapters(model)
    assert fused_unsupported_reason(model) is None
    fused = make_engine("native", model, tokenizer)
    hf = make_engine("native", model, tokenizer, kernels="hf")  # the module's own forward, adapters unmerged
    assert fused.kernels == "fused"
    prompts = [tokenizer("12 + 34 =")["input_ids"], tokenizer("7 + 8")["input_ids"]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0)
    a, b = fused.generate(prompts, params), hf.generate(prompts, params)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.policy_logprobs, b.policy_logprobs, rtol=0, atol=1e-5)


def test_weight_refresh_reuses_its_buffers_and_follows_the_adapters(policy_dir):
    model = wrapped(policy_dir)
    randomize_adapters(model)
    w = FusedWeights(model)
    w.refresh()
    o = model.model.layers[0].self_attn.o_proj
    torch.testing.assert_close(w.layers[0].wo, o.weight + o.get_delta_weight("default"), rtol=0, atol=1e-6)
    assert w.layers[0].wo.data_ptr() != w.layers[1].wo.data_ptr()  # each layer's merged o_proj is its own copy
    ptrs = [t.data_ptr() for lw in w.layers for t in (lw.wqkv, lw.wo, lw.wgu, lw.wd)]
    scratch = {k: v.data_ptr() for k, v in w._scratch.items()}
    with torch.no_grad():
        o.lora_B["default"].weight.add_(0.1)  # an optimizer step on the adapter
    w.refresh()
    torch.testing.assert_close(w.layers[0].wo, o.weight + o.get_delta_weight("default"), rtol=0, atol=1e-6)
    assert [t.data_ptr() for lw in w.layers for t in (lw.wqkv, lw.wo, lw.wgu, lw.wd)] == ptrs  # merged in place
    assert {k: v.data_ptr() for k, v in w._scratch.items()} == scratch
    with lora.adapters_disabled(model):
        w.refresh()  # the adapter state is part of the staleness key
        assert w.layers[0].wo.data_ptr() == o.weight.data_ptr()  # W₀ itself, no copy


def test_fused_path_says_why_it_falls_back(policy_dir):
    model = wrapped(policy_dir, target_modules=["q_proj", "embed_tokens"])
    reason = fused_unsupported_reason(model)
    assert reason is not None and "model.embed_tokens" in reason
    assert make_engine("native", model, None).kernels == "hf"


# ---- PEFT's checkpoint format, load and export ------------------------------------------------------
def test_saved_adapter_loads_with_peft_and_gives_the_in_run_logits(policy_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.models import save_model

    model = wrapped(policy_dir)
    randomize_adapters(model)
    save_model(model, load_tokenizer_of(policy_dir), tmp_path / "ckpt")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()  # the adapter only
    saved = load_file(tmp_path / "ckpt" / "adapter_model.safetensors")
    assert all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert lora.adapter_base(tmp_path / "ckpt") == policy_dir.resolve()
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy_dir), tmp_path / "ckpt").eval()
        torch.testing.assert_close(peft(input_ids=ids).logits, ours, rtol=0, atol=0)
        merged = load_model(tmp_path / "ckpt")  # our loader: base + adapter merged, a plain module
        assert not any(isinstance(m, type(model.model.layers[0].self_attn.q_proj)) for m in merged.modules())
        torch.testing.assert_close(merged(input_ids=ids).logits, ours, rtol=0, atol=1e-5)

    # export --merge: a plain HF folder that transformers loads without PEFT
    result = CliRunner().invoke(_cli_app(), ["export", str(tmp_path / "ckpt"), "--merge", str(tmp_path / "plain")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plain" / "model.safetensors").is_file() and not (tmp_path / "plain" / "adapter_config.json").exists()
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
        torch.testing.assert_close(plain(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
    again = CliRunner().invoke(_cli_app(), ["export", str(tmp_path / "ckpt"), "--merge", str(tmp_path / "plain")])
    assert again.exit_code == 2 and "already exists" in again.output


def test_export_names_a_broken_chain(policy_dir, tmp_path):
    from posttrain.models import save_model

    model = wrapped(policy_dir)
    save_model(model, load_tokenizer_of(policy_dir), tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (tmp_path / "ckpt" / "adapter_config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(_cli_app(), ["export", str(tmp_path / "ckpt"), "--merge", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "gone" in result.output and "is not a folder" in result.output


def load_tokenizer_of(path: Path):
    from posttrain.models import load_tokenizer

    return load_tokenizer(path)


def _cli_app():
    from posttrain.cli import app

    return app


# ---- every stage kind with LoRA -------------------------------------------------------------------
FAST = {"lr": 1e-2, "warmup_steps": 1, "min_lr_ratio": 1.0}


def make_ctx(run_dir: Path, start: Path, tokenizer, world, stage, targets: list[str] = ALL) -> tuple[RunContext, ListSink]:
    torch.manual_seed(0)
    recipe = Recipe(stages=[stage], threads=1, model={"lora": {**LORA, "target_modules": targets}},
                    evals=[{"task": "arithmetic", "levels": ["L2"], "max_new_tokens": 16}])
    sink = ListSink()
    return RunContext(run_dir=run_dir, recipe=recipe, device=torch.device("cpu"), tokenizer=tokenizer,
                      tasks=world_tasks(world),
                      telemetry=Telemetry.disabled(), sink=sink, start=start), sink


@pytest.fixture
def wraps(monkeypatch):
    """Every model `lora.wrap` returns during the test, with its adapters and heads as they were at the start."""
    seen: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    orig = lora.wrap

    def spy(model, **kw):
        out = orig(model, **kw)
        seen.append((out, {n: p.detach().clone() for n, p in out.named_parameters() if p.requires_grad}))
        return out

    monkeypatch.setattr(lora, "wrap", spy)
    return seen


def assert_lora_trained(model: torch.nn.Module, start: dict[str, torch.Tensor], base: dict[str, torch.Tensor],
                        *, heads: tuple[str, ...] = ()) -> None:
    """Every trainable tensor (adapters, heads) moved; every base weight is the start's, bit for bit."""
    now = dict(model.named_parameters())
    assert start and all(".lora_" in n or any(n.startswith(f"{h}.") for h in heads) for n in start), sorted(start)[:5]
    unchanged = [n for n, p in start.items() if torch.equal(p, now[n].detach())]
    assert not unchanged, f"adapter parameters that did not change: {unchanged}"
    frozen = {n.replace(".base_layer", "").replace(".original_module", ""): p for n, p in now.items() if not p.requires_grad}
    moved = [n for n, p in frozen.items() if n in base and not torch.equal(base[n], p.detach())]
    assert not moved, f"base weights that moved: {moved}"
    assert len([n for n in frozen if n in base]) >= len(base) - 1  # (a tied lm_head is the embedding itself)


def adapter_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    return load_file(folder / "adapter_model.safetensors")


def test_pretrain_and_sft_with_lora(tmp_path, policy_dir, tokenizer, world, wraps):
    base = load_file(policy_dir / "model.safetensors")
    cfg = PretrainStage(steps=6, batch_size=8, seq_len=48, documents=200, log_every=1, save_every=50, optim=FAST)
    ctx, sink = make_ctx(tmp_path / "pre", policy_dir, tokenizer, world, cfg)
    pre = run_pretrain(cfg, ctx)
    assert_lora_trained(*wraps[0], base)
    losses = [r["loss/lm"] for r in sink.records]
    assert sum(losses[-2:]) / 2 < losses[0], losses
    adapter_checkpoint(pre.checkpoint)

    cfg = SFTStage(steps=6, batch_size=8, max_len=96, heldout=8, data=[{"task": "arithmetic", "n": 8}],
                   log_every=1, save_every=50, optim=FAST)
    ctx, sink = make_ctx(tmp_path / "sft", pre.checkpoint, tokenizer, world, cfg)
    sft = run_sft(cfg, ctx)
    # SFT starts from pretrain's merged weights (base + pretrain adapter) with a fresh adapter of its own
    merged_pre = {k: v.detach() for k, v in load_model(pre.checkpoint).state_dict().items()}
    assert_lora_trained(*wraps[1], merged_pre)
    losses = [r["loss/sft"] for r in sink.records]
    assert losses[-1] < losses[0], losses  # same 8 examples every step
    assert lora.adapter_base(sft.checkpoint) == pre.checkpoint.resolve()
    assert lora.resolve_chain(sft.checkpoint) == (policy_dir, [pre.checkpoint.resolve(), sft.checkpoint.resolve()])


def test_reward_model_with_lora_trains_its_head(tmp_path, policy_dir, tokenizer, world, wraps):
    cfg = RewardModelStage(steps=6, batch_size=24, heldout=16, norm_samples=8, samples_per_prompt=4, max_new_tokens=8,
                           data=[{"task": "arithmetic", "n": 16}], rankings=[{"task": "arithmetic", "n": 8}],
                           log_every=1, optim=FAST)
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    run_reward_model(cfg, ctx)
    model, start = wraps[0]
    base = {k: v for k, v in load_scalar_model(policy_dir, zero_head=True).state_dict().items() if k != "score.weight"}
    assert_lora_trained(model, start, base, heads=("score",))
    steps = {r["step"]: r for r in sink.records}
    assert steps[1]["loss/reward_model"] == pytest.approx(0.6931, abs=1e-4)  # zero head: ln 2
    assert min(steps[s]["loss/reward_model"] for s in (4, 5, 6)) < 0.6931 - 0.025
    final = tmp_path / "checkpoints" / "reward_model" / "final"
    saved = adapter_checkpoint(final)
    assert any("score" in k for k in saved)  # the head is saved beside the adapter (modules_to_save)
    # the checkpoint loads as a scalar model with the in-run scores
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(token_scores(load_scalar_model(final), ids, mask), token_scores(model, ids, mask),
                                   rtol=0, atol=1e-5)


def test_dpo_with_lora_uses_the_disabled_adapters_as_reference(tmp_path, policy_dir, tokenizer, world, wraps, monkeypatch):
    loads = []
    orig = RunContext.load_model
    monkeypatch.setattr(RunContext, "load_model", lambda self, path: loads.append(path) or orig(self, path))
    cfg = DPOStage(steps=4, batch_size=16, grad_accum=2, data=[{"task": "arithmetic", "n": 16}], eval_per_level=0,
                   log_every=1, reference="recompute", optim={**FAST, "lr": 3e-3})
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    run_dpo(cfg, ctx)
    assert loads == [policy_dir]  # the policy's base only: no second copy for the reference
    assert_lora_trained(*wraps[0], load_file(policy_dir / "model.safetensors"))
    steps = {r["step"]: r for r in sink.records}
    assert steps[1]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)  # B = 0 at the start: policy = reference
    assert steps[4]["rewards/margin"] > steps[1]["rewards/margin"]
    assert steps[4]["loss/dpo"] < steps[1]["loss/dpo"]


def _digits(completions: list[str], **_) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def test_grpo_with_lora_learns_against_the_disabled_reference(tmp_path, policy_dir, tokenizer, world, wraps, monkeypatch):
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    cfg = GRPOStage(steps=8, batch_size=16, group_size=4, max_new_tokens=8, log_every=1, save_every=8, loss="dapo",
                    kl_coef=0.05, data=[{"task": "arithmetic", "n": 200}],
                    optim={"lr": 5e-2, "warmup_steps": 0, "min_lr_ratio": 1.0})
    # lm_head adapted too: on a random tiny model the share of digit tokens moves in 8 steps only through
    # the output layer (measured: projections only, 0.02 → 0.02 at lr 5e-2 to 2e-1; with lm_head 0.02 → 1.0)
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg, targets=ALL + ["lm_head"])
    spy, orig = [], RunContext.rollout_engine
    monkeypatch.setattr(RunContext, "rollout_engine", lambda self, model, backend="native": spy.append(orig(self, model, backend)) or spy[-1])
    result = run_grpo(cfg, ctx)
    assert_lora_trained(*wraps[0], load_file(policy_dir / "model.safetensors"))
    recs = [r for r in sink.records if r["stage"] == "grpo"]
    first = sum(r["reward/digits"] for r in recs[:3]) / 3
    last = sum(r["reward/digits"] for r in recs[-3:]) / 3
    assert last > first + 0.1, (first, last)
    assert recs[0]["kl"] == pytest.approx(0.0, abs=1e-6) and recs[-1]["kl"] > 0  # left the reference
    assert all(math.isfinite(r["clip/approx_kl"]) for r in recs)
    adapter_checkpoint(result.checkpoint)
    assert spy[0].kernels == "fused"  # sampled from the merged weights (approx_kl 0: the ratio is 1 at μ = 1)
    assert max(r["clip/approx_kl"] for r in recs) < 1e-6


def test_ppo_with_lora_policy_and_critic(tmp_path, policy_dir, tokenizer, world, wraps):
    rm_dir = make_reward_model(tmp_path / "rm", policy_dir)
    cfg = PPOStage(reward_model=str(rm_dir), steps=12, batch_size=16, minibatch_size=8, ppo_epochs=4, max_new_tokens=6,
                   data=[{"task": "arithmetic", "n": 64}], missing_eos_score=None, kl_coef=0.01, critic_lr=3e-3,
                   eval_per_level=2, eval_samples=1, log_every=1, optim={**FAST, "lr": 3e-2})
    ctx, sink = make_ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg, targets=ALL + ["lm_head"])  # as in GRPO
    result = run_ppo(cfg, ctx)
    (policy, p_start), (critic, c_start) = wraps
    assert_lora_trained(policy, p_start, load_file(policy_dir / "model.safetensors"))
    assert_lora_trained(critic, c_start, load_file(rm_dir / "model.safetensors"), heads=("score",))
    steps = {r["step"]: r for r in sink.records}
    assert steps[1]["kl"] == pytest.approx(0.0, abs=1e-4)
    # 16 replies a step score ±1.5 around their mean: the first four steps against the last four. (Eight
    # steps, two against two, failed on another CPU's round-off; recipe seeds 0–5 here clear this by 1.9–7.)
    first, last = [steps[s]["rm/score"] for s in (1, 2, 3, 4)], [steps[s]["rm/score"] for s in (9, 10, 11, 12)]
    assert sum(last) / 4 > sum(first) / 4 + 0.5, (first, last)
    assert "eval/h2h/gold_reward" in steps[12]
    adapter_checkpoint(result.checkpoint)


def test_grpo_resume_with_lora_is_exact(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    def cfg_():
        return GRPOStage(steps=4, batch_size=8, group_size=4, max_new_tokens=8, save_every=2, log_every=1, mu=2,
                         kl_coef=0.05, data=[{"task": "arithmetic", "n": 40}], optim={"lr": 3e-2, "warmup_steps": 0})

    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    ctx, _ = make_ctx(tmp_path / "straight", policy_dir, tokenizer, world, cfg_())
    straight = run_grpo(cfg_(), ctx).checkpoint

    class Killed(Exception):
        pass

    orig_save = grpo_mod.save

    def save_then_die(*args, **kw):
        orig_save(*args, **kw)
        raise Killed

    monkeypatch.setattr(grpo_mod, "save", save_then_die)
    ctx, _ = make_ctx(tmp_path / "killed", policy_dir, tokenizer, world, cfg_())
    with pytest.raises(Killed):
        run_grpo(cfg_(), ctx)
    monkeypatch.setattr(grpo_mod, "save", orig_save)
    ctx, _ = make_ctx(tmp_path / "killed", policy_dir, tokenizer, world, cfg_())
    torch.manual_seed(123)  # the resumed run must not depend on the global RNG it finds (nor redraw lora_A)
    resumed = run_grpo(cfg_(), ctx).checkpoint
    a, b = adapter_checkpoint(straight), adapter_checkpoint(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], torch.zeros_like(a[k])) for k in a if "lora_B" in k)  # it trained


def test_recipe_lora_block_is_validated(tmp_path):
    from posttrain.runtime.config import RecipeError
    from posttrain.runtime.recipe_file import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("stages: [{stage: sft, data: [{task: arithmetic, n: 8}]}]\nmodel: {lora: {rank: 8}}\n")
    with pytest.raises(RecipeError, match=r"r.yaml: model.lora.rank: unknown key"):
        load_recipe(path)
    path.write_text("stages: [{stage: sft, data: [{task: arithmetic, n: 8}]}]\n")
    assert load_recipe(path).model.lora is None  # full fine-tuning by default
    assert load_recipe(path, ["model.lora.r=8"]).model.lora.r == 8  # the rest take their defaults
    with pytest.raises(RecipeError, match=r"model.lora.r: Input should be greater than 0"):
        load_recipe(path, ["model.lora.r=0"])
