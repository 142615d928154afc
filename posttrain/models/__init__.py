"""Models and tokenizers: load any local HF causal LM; build tiny ones and their tokenizers locally."""

from posttrain.models.gguf import NAMED_CHECKPOINTS, checkpoint_folder, convert_gguf, smollm2_135m_instruct
from posttrain.models.loading import DTYPES, ModelLoadError, load_model, load_tokenizer, resolve_dtype, save_model
from posttrain.models.tiny import PRESETS, build_tiny, count_parameters, tiny_config
from posttrain.models.tokenizer import CHAT_TEMPLATE, IM_END, THINK_CLOSE, THINK_OPEN, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE", "DTYPES", "NAMED_CHECKPOINTS", "IM_END", "PRESETS", "THINK_CLOSE", "THINK_OPEN", "ModelLoadError",
    "build_tiny", "checkpoint_folder", "convert_gguf", "count_parameters", "load_model", "load_tokenizer", "resolve_dtype", "save_model",
    "smollm2_135m_instruct", "tiny_config", "train_tokenizer",
]
