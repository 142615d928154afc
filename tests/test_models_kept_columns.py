"""The last decoder layer on the kept columns only (`models/kept_columns.py`): the same log-probs as the whole
layer, the same gradients to round-off, and the layer left as it was wherever it cannot be restructured."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from posttrain.models import build_tiny, kept_columns, lora
from posttrain.rollout.text import positions_from_mask
from posttrain.stages._packing import shared_prompt_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0):
    return build_tiny("tiny-1m", vocab_size=64, seed=seed, pad_token_id=0, eos_token_id=1)


def _batch():
    """2 groups × 3 completions: a 6-token prompt each, completions of 5 tokens with some ending early."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 64, (2, 6), generator=g).repeat_interleave(3, 0)
    ids = torch.cat([prompts, torch.randint(2, 64, (6, 5), generator=g)], 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 9:], mask[4, 7:] = False, False
    return ids, mask, positions_from_mask(mask)


def _logps_and_grads(model, kept: bool, dtype=None):
    ids, mask, positions = _batch()
    model.zero_grad()
    usable = kept_columns.usable
    if not kept:
        kept_columns.usable = lambda _model: None
    try:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            logps = shared_prompt_logprobs(model, ids, mask, positions, 6)
    finally:
        kept_columns.usable = usable
    (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return logps.detach(), grads


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_the_log_probs_equal_the_whole_layers_and_the_gradients_to_round_off(dtype):
    model = _model()
    assert kept_columns.usable(model) is model.model.layers[-1]
    whole, whole_grads = _logps_and_grads(model, kept=False, dtype=dtype)
    kept, kept_grads = _logps_and_grads(model, kept=True, dtype=dtype)
    # the kept columns' arithmetic is the whole layer's, row by row: bit-equal log-probs
    assert torch.equal(kept, whole)
    # a weight gradient sums the same rows without the dead ones' zeros: the matmul may add in another order
    assert whole_grads.keys() == kept_grads.keys()
    for name, g in whole_grads.items():
        torch.testing.assert_close(kept_grads[name], g, rtol=1e-2 if dtype else 1e-5, atol=1e-6, msg=name)


def test_the_block_yields_the_kept_columns_hidden_states_and_restores_the_layer():
    model = _model()
    layer = model.model.layers[-1]
    ids = torch.randint(2, 64, (1, 9))
    keep = torch.tensor([8, 2, 5])
    with torch.no_grad():
        whole = model(input_ids=ids).logits[0]
        with kept_columns.kept_columns(model, keep) as kept:
            assert kept and "forward" in vars(layer)
            part = model(input_ids=ids, logits_to_keep=0).logits[0]
    assert part.shape == (3, whole.shape[-1])
    torch.testing.assert_close(part, whole[keep], rtol=0, atol=1e-6)
    assert "forward" not in vars(layer)
    with pytest.raises(RuntimeError, match="inside"), kept_columns.kept_columns(model, keep):
        raise RuntimeError("an error inside the block")
    assert "forward" not in vars(layer)  # restored on the way out of a failed forward too


def test_lora_adapters_in_the_last_layer_take_the_kept_columns():
    model = lora.wrap(_model(), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # non-zero adapters, so the adapted o_proj and MLP matter
    assert kept_columns.usable(model) is not None
    whole, whole_grads = _logps_and_grads(model, kept=False)
    kept, kept_grads = _logps_and_grads(model, kept=True)
    assert torch.equal(kept, whole)
    assert whole_grads.keys() == kept_grads.keys() and any("lora" in n for n in kept_grads)
    for name, g in whole_grads.items():
        torch.testing.assert_close(kept_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


class _MixingLayer(LlamaDecoderLayer):
    """A layer whose output mixes columns after the attention: the restructured forward would be wrong."""

    def forward(self, hidden_states, **kwargs):
        out = super().forward(hidden_states, **kwargs)
        return out + out.mean(1, keepdim=True)


def test_a_layer_it_does_not_reproduce_and_activation_checkpointing_keep_the_whole_layer():
    model = _model()
    last = model.model.layers[-1]
    mixing = _MixingLayer(model.config, layer_idx=len(model.model.layers) - 1)
    mixing.load_state_dict(last.state_dict())
    model.model.layers[-1] = mixing
    keep = torch.tensor([0, 3])
    with kept_columns.kept_columns(model, keep) as kept:
        assert not kept and "forward" not in vars(mixing)
    whole, _ = _logps_and_grads(model, kept=False)
    assert torch.equal(_logps_and_grads(model, kept=True)[0], whole)  # the probe's verdict: its own forward

    model = _model()
    model.activation_checkpointing_enable()
    model.train()
    with kept_columns.kept_columns(model, keep) as kept:
        assert not kept  # the backward runs the layer's forward again, after the block
    model.eval()
    with kept_columns.kept_columns(model, keep) as kept:
        assert kept  # not training: no recomputation
