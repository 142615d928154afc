"""Models: tiny presets, the local tokenizer, and round trips through plain `transformers`."""

from __future__ import annotations

import pytest
import torch
import transformers

from posttrain.models import ModelLoadError, build_tiny, count_parameters, load_model, load_tokenizer, save_model


@pytest.mark.parametrize(("preset", "low", "high"), [("tiny-1m", 0.7e6, 2e6), ("tiny-30m", 25e6, 35e6)])
def test_preset_sizes(preset, low, high):
    model = build_tiny(preset, vocab_size=512)
    assert low <= count_parameters(model) <= high


def test_tokenizer_splits_digits_and_keeps_think_tags(tokenizer):
    ids = tokenizer("<think>12+7=19</think> 19", add_special_tokens=False)["input_ids"]
    toks = tokenizer.convert_ids_to_tokens(ids)
    assert toks[0] == "<think>" and "</think>" in toks
    assert all(len(t.lstrip("Ġ")) <= 1 for t in toks if t.lstrip("Ġ").isdigit())  # one digit per token
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>12+7=19</think> 19"


def test_chat_template_masks_only_the_assistant_turn(tokenizer):
    msgs = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}]
    out = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    kept = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(kept) == "7<|im_end|>"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_saved_model_loads_with_plain_transformers(tmp_path, tokenizer, arch):
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), arch=arch, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    save_model(model, tokenizer, tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    plain_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([plain_tok("What is 3+4?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    assert plain_tok.eos_token == "<|im_end|>" and plain_tok.pad_token == "<|pad|>"
    assert plain_tok.chat_template == tokenizer.chat_template
    ours = load_model(tmp_path)
    assert type(ours).__name__ == ("LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM")
    assert load_tokenizer(tmp_path).pad_token_id == tokenizer.pad_token_id


def test_load_errors_name_the_folder(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match=r"does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_attention_choice():
    from posttrain.models.loading import choose_attention

    assert choose_attention("auto", "cpu", 160, torch.bfloat16) == "eager"   # measured faster there
    assert choose_attention("auto", "cpu", 160, None) is None                # fp32: the model's SDPA
    assert choose_attention("auto", "cpu", 4096, torch.bfloat16) is None     # long contexts: SDPA
    assert choose_attention("auto", "cuda", 160, torch.bfloat16) is None
    assert choose_attention("sdpa", "cpu", 160, torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="unknown attention"):
        choose_attention("flash", "cpu", 160)
