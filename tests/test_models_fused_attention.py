"""The attention with its rotary embedding fused (`models/fused_attention.py`) against `transformers`' own: logits
bit-identical under bf16 autocast with the C kernel and with the PyTorch ops, gradients within bf16 round-off and
equal in float64; the shared-prefix packing and LoRA through it; attentions it does not reproduce, and forwards
outside autocast, autograd or with a KV cache, left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from posttrain.models import build_tiny, fused_attention, load_model
from posttrain.models import lora as lora_mod
from posttrain.native import rope

pytestmark = pytest.mark.usefixtures("one_thread")


def train_grads(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, use_cache=False).logits
    logits.float().logsumexp(-1).sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return logits.detach(), torch.cat([p.grad.flatten() for p in params])


@pytest.fixture
def models():
    ref = build_tiny("tiny-1m", vocab_size=64, seed=3)
    ours = copy.deepcopy(ref)
    assert fused_attention.install(ours) == len(ours.model.layers)
    return ref, ours


def _ids(shape=(2, 24), seed=0):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kernel", ["c", "pytorch"])
def test_whole_model_under_bf16_autocast(models, monkeypatch, kernel):
    """Logits bit-identical to the unfused model's; every gradient within bf16 round-off of its own."""
    if kernel == "c" and rope.library() is None:
        pytest.skip("no C compiler")
    if kernel == "pytorch":
        monkeypatch.setattr(rope, "usable", lambda *a: None)
    calls = []
    real = rope.forward
    monkeypatch.setattr(rope, "forward", lambda *a: calls.append(1) or real(*a))
    ref, ours = models
    ids = _ids()
    (l0, g0), (l1, g1) = train_grads(ref, ids), train_grads(ours, ids)
    assert torch.equal(l0, l1)
    assert (len(calls) > 0) == (kernel == "c")
    rel = (g1 - g0).norm() / g0.norm()
    assert rel < 1e-2, rel


def test_the_rotation_node_gradient_is_exact_in_float64():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3 * 8, dtype=torch.float64, generator=gen, requires_grad=True)
    angles = torch.randn(2, 5, 4, dtype=torch.float64, generator=gen)
    emb = torch.cat((angles, angles), -1)
    assert torch.autograd.gradcheck(lambda t: fused_attention.rotary(t, emb.cos(), emb.sin(), 8), (x,))


def test_the_packed_shared_prompt_forward_takes_it(models):
    """GRPO's update: completions packed behind their prompt, through the shared-prefix attention — logits equal."""
    from posttrain.models.prefix_attention import Segments, shared_prefix

    ref, ours = models
    # one prompt of 5 tokens, then two completions of 4 and 3, positions continuing from the prompt
    ids = _ids((1, 12), seed=1)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7]])
    segments = Segments(prefixes=((0, 5),), slots=(((5, 4), (9, 3)),))
    mask = torch.ones(1, 1, 1, 12, dtype=torch.bool)
    outs = []
    for model in (ref, ours):
        with shared_prefix(model), torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(model(input_ids=ids, position_ids=positions, attention_mask=mask, segments=segments,
                              use_cache=False).logits)
    assert torch.equal(outs[0], outs[1])


def test_lora_projections_go_through_it():
    base = build_tiny("tiny-1m", vocab_size=64, seed=3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    ref = lora_mod.wrap(copy.deepcopy(base), r=4, alpha=8, dropout=0.0, target_modules=targets)
    fused = copy.deepcopy(base)
    assert fused_attention.install(fused) == len(base.model.layers)
    ours = lora_mod.wrap(fused, r=4, alpha=8, dropout=0.0, target_modules=targets)
    with torch.no_grad():  # the same adapter weights (B is zero at init: make it not)
        for (_, p0), (_, p1) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
            if p0.requires_grad:
                p0.normal_(0, 0.05)
                p1.copy_(p0)
    ids = _ids((2, 16))
    (l0, g0), (l1, g1) = train_grads(ref, ids), train_grads(ours, ids)
    assert torch.equal(l0, l1)
    assert (g1 - g0).norm() / g0.norm() < 1e-2


def test_outside_autocast_autograd_or_with_a_cache_the_module_forward_runs(models, monkeypatch):
    _, ours = models
    calls = []
    real = fused_attention.rotary
    monkeypatch.setattr(fused_attention, "rotary", lambda *a: calls.append(1) or real(*a))
    ids = _ids()
    ours(input_ids=ids, use_cache=False)                            # fp32, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            ours(input_ids=ids, use_cache=False)                    # a reference or evaluation forward
        ours(input_ids=ids, use_cache=True)                         # a KV cache: generation's forward
    assert calls == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours(input_ids=ids, use_cache=False)
    assert len(calls) == 2 * len(ours.model.layers)                 # queries and keys of every layer


def test_an_attention_it_does_not_reproduce_is_left_alone():
    model = build_tiny("tiny-1m", vocab_size=64, seed=3)
    attn = model.model.layers[0].self_attn
    cls = type(attn)
    odd = type("OddAttention", (cls,), {"forward": lambda self, *a, **k: (cls.forward(self, *a, **k)[0] * 2, None),
                                        "__module__": cls.__module__})
    attn.__class__ = odd
    with_norm = model.model.layers[1].self_attn
    with_norm.q_norm = nn.Identity()                                 # Qwen3's query/key norms: not a candidate
    assert fused_attention.install(model) == len(model.model.layers) - 2
    assert not fused_attention.is_fused(attn) and not fused_attention.is_fused(with_norm)
    assert fused_attention.install(model) == 0                       # idempotent


def test_load_model_fuses_only_for_autocast(tmp_path):
    build_tiny("tiny-1m", vocab_size=64).save_pretrained(tmp_path)
    trained = load_model(tmp_path, autocast_dtype=torch.bfloat16)
    plain = load_model(tmp_path)
    layers = len(trained.model.layers)
    assert sum(map(fused_attention.is_fused, trained.modules())) == layers
    assert sum(map(fused_attention.is_fused, plain.modules())) == 0
    trained.eval()
    trained.train()  # the subclass survives transformers' re-kernelize on train()/eval()
    assert sum(map(fused_attention.is_fused, trained.modules())) == layers


def test_a_qwen2_attention_with_projection_biases_is_bit_identical_too():
    ref = build_tiny("tiny-1m", vocab_size=64, seed=1, arch="qwen2")
    ours = copy.deepcopy(ref)
    assert fused_attention.install(ours) == len(ours.model.layers)
    assert ours.model.layers[0].self_attn.q_proj.bias is not None
    ids = _ids()
    (l0, g0), (l1, g1) = train_grads(ref, ids), train_grads(ours, ids)
    assert torch.equal(l0, l1)
    assert (g1 - g0).norm() / g0.norm() < 1e-2
