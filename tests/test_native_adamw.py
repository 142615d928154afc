"""AdamW's step in C (`native/adamw.py`, kernels/adamw.c) against PyTorch's fused CPU AdamW: parameters and moments
bit-identical, the vector and the plain-C builds, one and two threads, with and without weight decay, the clip's
factor folded in as `clip_grads_with_norm_` multiplies; the bf16 copy equal to the cast. `stages/_adamw.AdamW`
(what `build_optimizer` makes for a fused AdamW) equal to `torch.optim.AdamW(fused=True)` with the clip, its state
loadable by it, and PyTorch's step taking over — copies dropped — where the kernel does not take a parameter."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import weight_copies
from posttrain.native import adamw
from posttrain.runtime.config import OptimConfig
from posttrain.stages._adamw import AdamW
from posttrain.stages._training import build_optimizer

SHAPES = [(37, 19), (16 * 64 + 5,), (7,), (3, 4096)]  # tails of 15, 5 and 7 elements; one tensor of whole blocks


def _library(generic: bool):
    lib = adamw.library(generic)
    if lib is None:
        pytest.skip("no C compiler")
    return lib


@pytest.mark.parametrize("generic", [False, True], ids=["vector", "plain-C"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_step_equals_torch_fused_adamw_bitwise(generic, threads, weight_decay):
    lib = _library(generic)
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    betas, lr = (0.9, 0.95), 3e-3
    for shape in SHAPES:
        start = torch.randn(shape, generator=gen)
        theirs = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([theirs], lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
        ours, m, v = start.clone(), torch.zeros(shape), torch.zeros(shape)
        copy = torch.empty(shape, dtype=torch.bfloat16)
        for step in range(1, 6):
            grad = torch.randn(shape, generator=gen) * 10.0 ** (step - 3)
            coef = 1.0 if step % 2 else 0.37  # the clip's factor on even steps
            theirs.grad = grad.clone()
            if coef != 1.0:
                torch._foreach_mul_([theirs.grad], torch.tensor(coef))  # as clip_grads_with_norm_ scales
            opt.step()
            adamw.step(lib, ours, grad, m, v, copy, lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay,
                       step=step, coef=coef)
            state = opt.state[theirs]
            assert torch.equal(ours, theirs.detach()), (shape, step)
            assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"]), (shape, step)
            assert torch.equal(copy, ours.to(torch.bfloat16)), (shape, step)


def test_the_vector_build_takes_the_vector_path():
    lib = _library(False)
    assert lib.posttrain_adamw_vector_path() in (0, 1)
    assert _library(True).posttrain_adamw_vector_path() == 0


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 8))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(step)) * 5
    return model(x).pow(2).mean()


def test_the_optimizer_equals_torch_fused_adamw_with_the_clip():
    """`build_optimizer` (fused) steps our AdamW with the clip folded in; torch.optim.AdamW(fused=True) after
    `clip_grads_with_norm_` — the same parameters and state, bit for bit, and each loads the other's state."""
    _library(False)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, fused=True)
    ours_model, theirs_model = _model(), _model()
    ours = build_optimizer(ours_model, cfg)
    assert isinstance(ours, AdamW)
    groups = [{"params": [p for p in theirs_model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in theirs_model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    theirs = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)
    limit, clipped = 0.5, 0
    for step in range(6):
        for model in (ours_model, theirs_model):
            _loss(model, step).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ours_model.parameters()])
        coef = limit / (norm + 1e-6)
        clipped += bool(coef < 1.0)
        assert ours.kernel_ready()
        ours.step(coef=float(torch.clamp(coef, max=1.0)))
        torch.nn.utils.clip_grads_with_norm_(list(theirs_model.parameters()), limit, norm)
        theirs.step()
        for opt in (ours, theirs):
            opt.zero_grad(set_to_none=True)
    assert clipped >= 2  # the clip took part
    for a, b in zip(ours_model.parameters(), theirs_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ours.state.values(), theirs.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())


def test_a_parameter_the_kernel_does_not_take_sends_the_step_to_torch_and_drops_the_copies():
    _library(False)
    model = _model()
    for p in model.parameters():
        weight_copies.want(p)
    opt = AdamW(model.parameters(), lr=1e-2)
    _loss(model, 0).backward()
    opt.step()
    weights = list(model.parameters())
    assert all(weight_copies.fresh(p, torch.bfloat16) is not None for p in weights)
    assert torch.equal(weight_copies.fresh(weights[0], torch.bfloat16), weights[0].detach().to(torch.bfloat16))
    _loss(model, 1).backward()
    weights[0].grad = weights[0].grad.t().contiguous().t()  # a transposed gradient: not the kernel's
    assert not opt.kernel_ready()
    before = weights[0].detach().clone()
    opt.step()
    assert not torch.equal(before, weights[0].detach())
    assert all(weight_copies.fresh(p, torch.bfloat16) is None for p in weights)
