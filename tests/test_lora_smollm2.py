"""LoRA on a real pretrained model (SmolLM2-135M-Instruct: Llama, 30 layers, 49,152 vocabulary, tied
embeddings): the reference with adapters disabled is the base model within 1e-6, the saved adapter
loads with PEFT and gives our in-run logits, and the fused decode path samples from the merged weights."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import load_model, load_tokenizer, lora, save_model
from posttrain.rollout import SamplingParams, make_engine
from posttrain.stages._training import ReferencePolicy

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # ~40 s unloaded (a real 135M model); tests/test_lora.py covers the subsystem by default

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapted(smollm2):
    """SmolLM2 with r=8 adapters on every projection, B given values (a trained adapter's stand-in)."""
    torch.manual_seed(0)
    model = lora.wrap(load_model(smollm2), r=8, alpha=16.0, dropout=0.0, target_modules=TARGETS, base=smollm2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora.adapter_parameters(model).items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return model.eval()


@pytest.fixture(scope="module")
def batch(smollm2):
    tok = load_tokenizer(smollm2)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in ("What is 12 + 35?", "Name a colour of the sky.", "Write one word.")]
    enc = tok(texts, return_tensors="pt", padding=True)
    return tok, enc["input_ids"], enc["attention_mask"]


def test_reference_with_adapters_disabled_equals_the_base_model(smollm2, adapted, batch):
    _, ids, mask = batch
    base = load_model(smollm2).eval()
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask).logits
        with ReferencePolicy(adapted, shared=True)() as ref:
            got = ref(input_ids=ids, attention_mask=mask).logits
        on = adapted(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max().item() <= 1e-6
    assert (on[keep] - want[keep]).abs().max().item() > 1e-2  # the adapters do change the policy


def test_saved_adapter_loads_with_peft_and_gives_the_in_run_logits(smollm2, adapted, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tok, ids, mask = batch
    save_model(adapted, tok, tmp_path / "ckpt")
    assert lora.adapter_base(tmp_path / "ckpt") == smollm2.resolve()
    with torch.no_grad():
        ours = adapted(input_ids=ids, attention_mask=mask).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), tmp_path / "ckpt").eval()
        theirs = peft(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (theirs[keep] - ours[keep]).abs().max().item() == 0.0  # the same modules, the same saved tensors


def test_fused_decode_samples_the_merged_weights(adapted, batch):
    tok, ids, mask = batch
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    fused = make_engine("native", adapted, tok)
    hf = make_engine("native", adapted, tok, kernels="hf")  # the PEFT forward, adapters unmerged
    assert fused.kernels == "fused"
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    a, b = fused.generate(prompts, params), hf.generate(prompts, params)
    assert torch.equal(a.completion_ids, b.completion_ids)
    keep = a.completion_mask.bool()
    assert (a.policy_logprobs[keep] - b.policy_logprobs[keep]).abs().max().item() < 1e-4
