"""Weight sync (posttrain/distributed/weight_sync.py): full and delta payloads by hand, and the exactness
claim — a worker that applies every delta holds, bit for bit, what a full send of each sync would give it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posttrain.distributed.weight_sync import (
    SyncMode,
    SyncState,
    apply_payload,
    element_delta,
    fingerprint,
    full_payload,
    named_tensors,
    plan_sync,
    to_wire,
)


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
                                        for k in a)


def test_full_sends_every_tensor_and_counts_its_bytes():
    w = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    state = SyncState(SyncMode.FULL)
    for _ in range(2):  # full mode never skips, even when nothing changed
        p = plan_sync(state, w)
        assert set(p.dense) == {"a", "b"} and not p.sparse
        assert p.nbytes == p.full_bytes == 3 * 4 * 4 + 5 * 2  # 48 fp32 bytes + 10 bf16 bytes = 58


def test_delta_skips_unchanged_sends_changed_fp32_whole_and_sparse_bf16_elements():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.arange(100, dtype=torch.bfloat16)
    state = SyncState(SyncMode.DELTA)
    first = plan_sync(state, {"a": a, "b": b})
    assert set(first.dense) == {"a", "b"}  # the first delta is a full send: the worker holds nothing yet
    assert first.nbytes == 48 + 200

    a2 = a.clone()
    a2[0, 0] = -1.0                         # fp32: one element moved → the whole tensor (48 bytes)
    b2 = b.clone()
    b2[[3, 50]] = torch.tensor([7.5, -2.0], dtype=torch.bfloat16)  # bf16: 2 of 100 elements
    p = plan_sync(state, {"a": a2, "b": b2})
    assert set(p.dense) == {"a"} and set(p.sparse) == {"b"}
    assert p.sparse["b"].indices.tolist() == [3, 50] and p.sparse["b"].indices.dtype == torch.int32
    assert p.nbytes == 48 + 2 * 4 + 2 * 2   # 48 + 2 int32 indices + 2 bf16 values = 60, vs 248 full
    assert p.full_bytes == 248

    p = plan_sync(state, {"a": a2, "b": b2})  # nothing changed
    assert not p.dense and not p.sparse and p.unchanged == 2 and p.nbytes == 0


def test_a_bf16_tensor_with_many_changes_goes_whole():
    b = torch.zeros(30, dtype=torch.bfloat16)
    state = SyncState(SyncMode.DELTA)
    plan_sync(state, {"b": b})
    b2 = b.clone()
    b2[:10] = 1.0  # 10 of 30 changed: sparse is 10 × (4 + 2) = 60 bytes, whole is 60 bytes → not smaller
    p = plan_sync(state, {"b": b2})
    assert set(p.dense) == {"b"} and not p.sparse
    b3 = b2.clone()
    b3[:9] = 2.0  # 9 changed: 54 < 60 → sparse
    assert set(plan_sync(state, {"b": b3}).sparse) == {"b"}


def test_element_delta_compares_bits_not_values():
    old = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    d = element_delta(old, new)
    assert d.indices.tolist() == [0]  # −0.0 == 0.0 as values, not as bits; the same NaN bits are unchanged


def test_a_worker_applying_every_delta_equals_a_full_send_bitwise():
    # A learner in fp32 takes AdamW steps; a bf16 wire (a bf16-sampling engine) and an fp32 one; one worker
    # applies delta payloads, another full ones, after every step: their tensors are the same bits.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for wire_dtype in (torch.bfloat16, None):
        state = SyncState(SyncMode.DELTA)
        wire = to_wire(named_tensors(model), wire_dtype)
        delta_worker = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in wire.items()}
        full_worker = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in wire.items()}
        apply_payload(delta_worker, plan_sync(state, wire))
        saved = 0
        for step in range(6):
            ids = torch.randint(0, 8, (4, 5))  # only 8 of 64 embedding rows get a gradient
            loss = model[2](model[1](model[0](ids))).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            wire = to_wire(named_tensors(model), wire_dtype)
            p = plan_sync(state, wire)
            saved += p.full_bytes - p.nbytes
            apply_payload(delta_worker, p)
            apply_payload(full_worker, full_payload(wire))
            assert bits_equal(delta_worker, full_worker), (wire_dtype, step)
        if wire_dtype is torch.bfloat16:
            assert saved > 0  # at lr 1e-3 many bf16 roundings stay put: the delta moved fewer bytes


def test_tied_weights_are_sent_once_and_unknown_names_are_refused():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head and its embedding
    names = named_tensors(model)
    assert list(names) == ["0.weight"]  # 40 floats once, not twice
    target = dict(model.state_dict(keep_vars=True))
    with pytest.raises(KeyError, match="no tensor 'lm_head.weight'"):
        apply_payload(target, full_payload({"lm_head.weight": torch.zeros(10, 4)}))


def test_fingerprints_see_dtype_shape_and_bytes():
    x = torch.zeros(4)
    assert fingerprint(x) == fingerprint(torch.zeros(4))
    assert fingerprint(x) != fingerprint(torch.zeros(2, 2))          # same bytes, another shape
    assert fingerprint(x) != fingerprint(torch.zeros(4, dtype=torch.int32))  # same bytes, another dtype
    y = x.clone()
    y[3] = 1e-30
    assert fingerprint(x) != fingerprint(y)
