"""The jobs built on the pipeline of attnkit/engine/ (docs/architecture.md): each runs a corpus or generated inputs
through a model for one purpose, and reports through a callback or returns its result (none imports click).

    detect, detect_options      previous-token, duplicate, induction and retrieval heads (`attnkit detect-heads`)
    head_means                  the mean output of every head over a corpus (mean ablation)
    maps                        every head's map of one text (`attnkit.attention_maps`)
    compare                     two models compared head by head, batch by batch
    extract_job, distances_job  the jobs behind `attnkit extract` and `attnkit distances`
    job_options                 their options, checked once

The names below are imported on first use (they pull in torch).
"""
import importlib

_LAZY = {"ModelComparison": "compare", "PairedCollector": "compare", "compare_models": "compare",
         "similarity_sums": "compare", "AttentionMaps": "maps", "attention_maps": "maps", "head_means": "head_means",
         "detect_heads": "detect"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
