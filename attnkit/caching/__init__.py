"""Keeping what a forward computed, to use it again (docs/interventions.md, "Head outputs" and "Sweeps").

    heads     `cache_heads`: each layer's per-head outputs (B × L × H × D, before the output projection)
    layers    the model's transformer layers; their outputs captured during a forward, and forwards that start at a
              layer from a captured hidden state instead of computing the layers before it
"""
from .heads import HeadCache, cache_heads
from .layers import capturing_layer_outputs, encoder_layers, starting_at

__all__ = ["HeadCache", "cache_heads", "capturing_layer_outputs", "encoder_layers", "starting_at"]
