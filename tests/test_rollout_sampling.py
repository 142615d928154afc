"""The sampler on known small distributions: χ² fits, filters never leak, log-probs are the renormalised ones."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.rollout import sampling
from posttrain.rollout.sampling import (
    SamplingParams,
    draw_uniforms,
    process_logits,
    sample,
    sample_into,
)

P = torch.tensor([0.1, 0.2, 0.3, 0.4])
LOGITS = P.log()
N = 10_000
CHI2_CRIT_DF3 = 16.266  # χ² critical value, 3 degrees of freedom, α = 0.001 (standard table)
CHI2_CRIT_DF1 = 10.828  # 1 degree of freedom, α = 0.001
FORMS = {"softmax": 10**9, "exp": 0}  # `sampling.SMALL_VOCAB` forcing each form of the draw on any vocabulary


@pytest.fixture(autouse=True, params=list(FORMS))
def form(request, monkeypatch):
    """Every test runs under both forms of the inversion draw (softmax for small vocabularies, exp(z − max) above)."""
    monkeypatch.setattr(sampling, "SMALL_VOCAB", FORMS[request.param])
    return request.param


def draw(params: SamplingParams, seed: int = 0, logits: torch.Tensor = LOGITS) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    rows = logits.expand(N, -1).clone()
    return sample(rows, params, None if params.greedy else draw_uniforms(1, N, gen, rows.device)[0])


def chi2(tokens: torch.Tensor, expected_p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=expected_p.numel()).double()
    support = expected_p > 0
    exp = expected_p.double() * tokens.numel()
    return float(((counts[support] - exp[support]) ** 2 / exp[support]).sum())


def test_temperature_one_matches_the_distribution_by_chi2():
    tokens, logprobs, policy = draw(SamplingParams(temperature=1.0))
    assert chi2(tokens, P) < CHI2_CRIT_DF3
    # negative control, so the test can fail: the same draws are far from uniform
    # expected under uniform 2500 each; observed ≈ 1000/2000/3000/4000 → χ² ≈ (1500²+500²+500²+1500²)/2500 = 2000
    assert chi2(tokens, torch.full((4,), 0.25)) > 1000
    # identity sampling: both log-probs are log p of the drawn token
    assert torch.allclose(logprobs, P.log()[tokens], atol=1e-6)
    assert torch.allclose(policy, P.log()[tokens], atol=1e-6)


def test_temperature_half_squares_the_probabilities():
    # q ∝ p^(1/0.5) = p² = [.01, .04, .09, .16] / 0.30 = [1/30, 4/30, 9/30, 16/30]
    q = torch.tensor([1.0, 4.0, 9.0, 16.0]) / 30
    tokens, logprobs, policy = draw(SamplingParams(temperature=0.5))
    assert chi2(tokens, q) < CHI2_CRIT_DF3
    assert torch.allclose(logprobs, q.log()[tokens], atol=1e-5)   # under the sampling distribution
    assert torch.allclose(policy, P.log()[tokens], atol=1e-6)     # under the raw model, T = 1


def test_top_k_never_emits_an_excluded_token_and_renormalises():
    # top-2 of [.1, .2, .3, .4] keeps tokens 2, 3 with q = [3/7, 4/7]
    tokens, logprobs, _ = draw(SamplingParams(top_k=2))
    assert set(tokens.tolist()) == {2, 3}
    assert torch.allclose(logprobs, torch.tensor([0, 0, 3 / 7, 4 / 7]).clamp_min(1e-30).log()[tokens], atol=1e-5)
    counts = torch.bincount(tokens, minlength=4)
    # χ² with 1 dof over the two kept tokens
    exp = torch.tensor([3 / 7, 4 / 7]) * N
    assert float(((counts[2:] - exp) ** 2 / exp).sum()) < CHI2_CRIT_DF1


@pytest.mark.parametrize("top_p, kept", [
    (0.65, {2, 3}),  # ascending cumsum .1, .3, .6, 1.0; drop cum ≤ 1 − .65 = .35 → drop tokens 0, 1
    (0.35, {3}),     # drop cum ≤ .65 → drop 0, 1, 2; the 0.4 token alone has mass ≥ .35
    (0.95, {0, 1, 2, 3}),  # drop cum ≤ .05 → nothing
])
def test_top_p_never_emits_an_excluded_token(top_p, kept):
    tokens, _, _ = draw(SamplingParams(top_p=top_p))
    assert set(tokens.tolist()) == kept


def test_min_p_drops_tokens_below_the_scaled_max():
    # threshold = 0.6 · 0.4 = 0.24 → keep 0.3 and 0.4
    tokens, logprobs, _ = draw(SamplingParams(min_p=0.6))
    assert set(tokens.tolist()) == {2, 3}
    assert torch.allclose(logprobs, torch.tensor([1.0, 1.0, 3 / 7, 4 / 7]).log()[tokens], atol=1e-5)


def test_greedy_takes_the_argmax_with_zero_sampling_logprob():
    tokens, logprobs, policy = draw(SamplingParams(temperature=0))
    assert (tokens == 3).all()
    assert (logprobs == 0).all()                        # point mass: log 1 = 0
    assert torch.allclose(policy, torch.tensor(math.log(0.4)))  # log 0.4 = −0.9163


def process_logits_naive(row: list[float], params: SamplingParams) -> list[float]:
    """One row, plain Python: temperature → top-k → top-p → min-p, as in transformers' warpers."""
    z = [x / params.temperature for x in row]
    if params.top_k:
        kth = sorted(z, reverse=True)[params.top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    if params.top_p < 1:
        m = max(z)
        probs = [math.exp(x - m) for x in z]
        total = sum(probs)
        probs = [p / total for p in probs]
        order = sorted(range(len(z)), key=lambda i: probs[i])  # ascending
        cum, drop = 0.0, set()
        for i in order[:-1]:
            cum += probs[i]
            if cum <= 1 - params.top_p:
                drop.add(i)
        z = [-math.inf if i in drop else x for i, x in enumerate(z)]
    if params.min_p:
        m = max(z)
        probs = [math.exp(x - m) if x > -math.inf else 0.0 for x in z]
        total = sum(probs)
        pmax = max(probs) / total
        z = [x if p / total >= params.min_p * pmax else -math.inf for x, p in zip(z, probs)]
    return z


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05),
])
def test_process_logits_matches_the_naive_row_loop(params):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float() * 2
    fast = process_logits(logits, params)
    for r in range(6):
        naive = torch.tensor(process_logits_naive(logits[r].double().tolist(), params), dtype=torch.float32)
        assert torch.equal(torch.isinf(fast[r]), torch.isinf(naive)), f"row {r}: different kept sets"
        kept = ~torch.isinf(naive)
        assert torch.allclose(fast[r][kept], naive[kept], atol=1e-5)


def test_seeded_uniforms_are_reproducible_and_seed_dependent():
    a = draw_uniforms(3, 7, torch.Generator().manual_seed(5), torch.device("cpu"))
    b = draw_uniforms(3, 7, torch.Generator().manual_seed(5), torch.device("cpu"))
    c = draw_uniforms(3, 7, torch.Generator().manual_seed(6), torch.device("cpu"))
    assert a.shape == (3, 7) and torch.equal(a, b) and not torch.equal(a, c)
    assert ((a >= 0) & (a < 1)).all()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),                                  # identity: one log-softmax serves both
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
])
def test_sample_into_is_the_same_draw_as_sample(params):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 40, generator=g) * 2
    u = draw_uniforms(1, 9, g, torch.device("cpu"))[0]
    want = sample(logits, params, u)
    tokens, lp, plp = torch.empty(9, dtype=torch.long), torch.empty(9), torch.empty(9)
    sample_into(logits, params, u, tokens, lp, plp)
    assert torch.equal(tokens, want[0])                               # binary search = count
    # the same log-softmax (softmax form), or z − max − log total (exp form): equal to fp32 round-off
    assert torch.allclose(lp, want[1], atol=1e-5, rtol=0) and torch.allclose(plp, want[2], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="greedy"):
        sample_into(logits, SamplingParams(temperature=0), u, tokens, lp, plp)


def test_inversion_picks_the_token_whose_interval_holds_u():
    """q = [.1, .2, .3, .4]: cumulative [.1, .3, .6, 1]; U in [.3, .6) is token 2, and so on."""
    u = torch.tensor([0.0, 0.0999, 0.1001, 0.2999, 0.3001, 0.5999, 0.6001, 0.9999])
    tokens, _, _ = sample(LOGITS.expand(8, -1), SamplingParams(temperature=1.0), u)
    assert tokens.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_zero_probability_tokens_are_never_drawn_even_at_the_interval_ends():
    """Filtered tokens (−inf) at the start, the middle and the end of the vocabulary: U = 0 and the
    largest float below 1 must still land on a kept token (the target stays below the total)."""
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.5, float("-inf")]]).expand(3, -1)
    u = torch.tensor([0.0, 0.5, 1.0 - 2 ** -24])
    for fn in ("sample", "sample_into"):
        if fn == "sample":
            tokens = sample(logits, SamplingParams(temperature=1.0), u)[0]
        else:
            tokens = torch.empty(3, dtype=torch.long)
            sample_into(logits, SamplingParams(temperature=1.0), u, tokens, torch.empty(3), torch.empty(3))
        assert set(tokens.tolist()) <= {1, 3}, fn
        assert tokens[0] == 1 and tokens[2] == 3, fn


def test_inversion_is_exact_on_a_large_vocabulary():
    """152k tokens: the drawn token's cumulative interval holds U · total in float64 arithmetic too
    (the float32 sums are accurate to ~1e-7, far below any token's share that matters)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 151_936, generator=g) * 3
    u = draw_uniforms(1, 4, g, torch.device("cpu"))[0]
    tokens, lp, _ = sample(logits, SamplingParams(temperature=1.0), u)
    p = logits.double().softmax(-1)
    cdf = p.cumsum(-1)
    for r, t in enumerate(tokens.tolist()):
        lo = float(cdf[r, t - 1]) if t else 0.0
        assert lo - 1e-6 <= float(u[r]) <= float(cdf[r, t]) + 1e-6
    assert torch.allclose(lp.double(), p.log().gather(1, tokens[:, None])[:, 0], atol=1e-5)
    got, glp, gplp = torch.empty(4, dtype=torch.long), torch.empty(4), torch.empty(4)
    sample_into(logits, SamplingParams(temperature=1.0), u, got, glp, gplp)
    assert torch.equal(got, tokens) and torch.equal(glp, gplp)
    # Two fp32 log-sum-exps over 152k terms in different reduction orders: each sum carries ~1e-5
    # relative error, so log-probs of size ~8 agree to ~1e-4 (measured 1.2e-4 on an AVX2 CPU, whose
    # 8-wide reductions group the terms differently from AVX-512's 16-wide ones)
    assert torch.allclose(glp, lp, atol=3e-4, rtol=0)


@pytest.mark.parametrize("vocab, params", [(40, SamplingParams(temperature=1.0)),
                                           (5_000, SamplingParams(temperature=0.8, top_k=50)),
                                           (151_936, SamplingParams(temperature=1.0, top_p=0.9))])
def test_both_forms_draw_the_same_tokens(vocab, params, monkeypatch):
    """softmax and exp(z − max) round the cumulative sums differently (≲ 1e-7 of the total), so a U within
    that of an interval edge could go either way; these seeded draws sit nowhere near one."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, vocab, generator=g) * 3
    u = draw_uniforms(1, 6, g, torch.device("cpu"))[0]
    out = {}
    for name, limit in FORMS.items():
        monkeypatch.setattr(sampling, "SMALL_VOCAB", limit)
        tokens, lp, plp = torch.empty(6, dtype=torch.long), torch.empty(6), torch.empty(6)
        sample_into(logits, params, u, tokens, lp, plp)
        out[name] = tokens, lp, plp
    (ta, la, pa), (tb, lb, pb) = out["softmax"], out["exp"]
    assert torch.equal(ta, tb)
    assert torch.allclose(la, lb, atol=1e-5, rtol=0) and torch.allclose(pa, pb, atol=1e-5, rtol=0)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.0),
    ("max_new_tokens", 0), ("stop", [""]),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
