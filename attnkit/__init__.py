"""attnkit: measure what the attention heads of transformer encoders do, over whole corpora.

    model, tokenizer = attnkit.load_model()          # the embedded MiniLM
    feats = attnkit.extract(["A text.", ("A pair", "of texts.")], (model, tokenizer))
    feats.to_pandas()
    maps = attnkit.attention_maps("A text.", (model, tokenizer))   # every head's map of one text

The layers of the package and what each may import: docs/architecture.md.

`import attnkit` is cheap: the public names below are imported when first used (torch, transformers and
scikit-learn load only then), so the command line answers `--help` at once. `attn_implementation="attnkit"`
works after `import attnkit` all the same: the attention function is registered with transformers as soon as
transformers is imported (at once when it already is).
"""
import importlib
import sys

from .errors import AttnkitError
from .features import feature_names
from .process import after_import
from .run.versions import attnkit_version

__version__ = attnkit_version()

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "HeadFeatures": "run.head_features",
    "Intervention": "interventions",
    "attention_maps": "jobs.maps",
    "backend_info": "ops",
    "cache_heads": "caching",
    "cluster": "analysis",
    "detect_heads": "jobs.detect",
    "extract": "engine.extract",
    "head_means": "jobs.head_means",
    "instrument": "models",
    "intervene": "interventions",
    "load_model": "models",
    "process_changes": "process",
    "register_attention": ("hf_attention", "register"),
    "sentences": "interventions",
    "track": "training",
    "qk_clip": "training",
    "to_str_tokens": "tokens",
}


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__():
    """The public API only (`__all__`, the names imported on first use, `__version__`), not the modules this
    file works with (sys, importlib) nor the helpers it imports."""
    return sorted({*__all__, *_LAZY, "__version__"})


def _register_attention() -> None:
    """Import attnkit.hf_attention, which registers "attnkit" with transformers when it has loaded (a module
    that is loading it already, e.g. the import of transformers inside it, leaves the registration to it)."""
    try:
        importlib.import_module(f"{__name__}.hf_attention")
    except Exception as exc:  # never break the user's `import transformers`; instrument() registers again
        import logging

        logging.getLogger("attnkit").warning("attnkit could not register its attention with transformers: %s", exc)


if "transformers" in sys.modules:
    _register_attention()
elif not any(getattr(f, "module", None) == "transformers" for f in sys.meta_path):
    # Registers attnkit attention right after `transformers` is imported (a finder that removes itself at that
    # import; attnkit.process lists it meanwhile, ATTNKIT_IMPORT_HOOK=0 leaves it out and instrument() registers
    # instead): `AutoModel.from_pretrained(path, attn_implementation="attnkit")` then works after `import attnkit`,
    # in whichever order the two are imported, without `import attnkit` paying for transformers itself.
    after_import("import_hook", "transformers", _register_attention,
                 'a finder in sys.meta_path that registers attn_implementation="attnkit" when transformers loads')

__all__ = [
    "AttnkitError", "HeadFeatures", "Intervention", "attention_maps", "backend_info", "cache_heads", "cluster",
    "detect_heads",
    "extract", "feature_names", "head_means", "instrument", "intervene", "load_model", "process_changes", "qk_clip",
    "sentences", "to_str_tokens", "track",
]
