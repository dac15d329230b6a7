"""Head caches (attnkit.cache_heads): each layer's per-head outputs, after the intervention's replaced head outputs,
handed to an attnkit.caching.HeadCache (`record(layer, out)`). Caches hold the unpruned heads: a removed head
outputs 0."""
from __future__ import annotations

from ...arch.pruning import to_unpruned
from ..call import AttentionCall
from .base import BaseConsumer, Result


class HeadCaching(BaseConsumer):
    role = "head_cache"

    def __init__(self, cache):
        self.cache = cache

    def after(self, call: AttentionCall, result: Result) -> None:
        out = result.out
        self.cache.record(call.layer, out if call.kept is None else to_unpruned(out.transpose(1, 2),
                                                                                call.kept).transpose(1, 2))
