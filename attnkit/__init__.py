"""attnkit: measure what the attention heads of transformer encoders do, over whole corpora.

    model, tokenizer = attnkit.load_model()          # the embedded MiniLM
    feats = attnkit.extract(["A text.", ("A pair", "of texts.")], (model, tokenizer))
    feats.to_pandas()

The layers of the package and what each may import: docs/architecture.md.
"""
from .caching import cache_heads
from .engine.extract import extract
from .engine.head_means import head_means
from .errors import AttnkitError
from .features import feature_names
from .hf_attention import register as register_attention
from .interventions import Intervention, intervene, sentences
from .models import instrument, load_model
from .ops import backend_info
from .run.head_features import HeadFeatures
from .run.versions import attnkit_version

__version__ = attnkit_version()
register_attention()  # attn_implementation="attnkit" works after `import attnkit`


def __getattr__(name):
    # `attnkit.cluster` without paying for scikit-learn's import on every `import attnkit`
    if name == "cluster":
        from .analysis import cluster

        return cluster
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")


__all__ = [
    "AttnkitError", "HeadFeatures", "Intervention", "backend_info", "cache_heads", "cluster", "extract",
    "feature_names", "head_means",
    "instrument", "intervene", "load_model", "sentences",
]
