"""What attnkit knows of the attention layers of each architecture it can change (docs/pruning.md,
docs/features.md "Norm-weighted features"):

    architectures   where a model keeps the query, key, value and output projections of each layer
    norms           the per-key norms ‖f_h(x_t)‖ of Kobayashi et al. 2020, from the values and W_O
    pruning         removing heads physically, and loading a pruned model back

This package is in the model layer (docs/architecture.md): it imports only the layers below it, and
`attnkit.hf_attention` and `attnkit.models` use it.
"""
from .architectures import AttentionLayer, attention_layers, layout_of
from .norms import key_norms
from .pruning import kept_heads, load_pruned_model, prune_heads, pruned_head_grid, removed_heads

__all__ = ["AttentionLayer", "attention_layers", "key_norms", "kept_heads", "layout_of", "load_pruned_model",
           "prune_heads", "pruned_head_grid", "removed_heads"]
