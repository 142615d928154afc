"""Tokenizers trained locally with the `tokenizers` library, wrapped as `PreTrainedTokenizerFast`.

The tiny models of the demo need a vocabulary no hub can give us. We train a byte-level BPE on a
world's corpus with digits split one per token (arithmetic on multi-digit tokens is much harder to
learn), add the chat-format special tokens, and attach a ChatML chat template, so the result saves and
loads with plain `transformers` (`AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
EOS = "<|endoftext|>"  # separates pretraining documents
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # ends every chat turn; the assistant's stop token
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# ChatML. `add_generation_prompt` opens an assistant turn; `{% generation %}` marks the assistant's
# tokens so `return_assistant_tokens_mask=True` yields the response-only loss mask.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 512, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (digits one per token) on `texts` and wrap it for `transformers`.

    The vocabulary may come out smaller than `vocab_size` on a small closed world; that is fine.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, EOS, IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # <think> tags are ordinary added tokens (not special): they must survive decode(skip_special_tokens=True).
    tok.add_tokens([THINK_OPEN, THINK_CLOSE])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[EOS, IM_START],
        padding_side="left",  # generation pads on the left; training code passes explicit masks
        model_max_length=4096,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
