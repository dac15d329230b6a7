"""Observers (attnkit.models.observing): callables that see each layer's q and k before the op (`QKObserver`:
statistics that need q and k themselves, e.g. the Jensen-Shannon distances between heads), or each head's max logit
from the op's own call (`MaxLogitObserver`: an observer with a true `takes_max_logit`, e.g. extraction's
--max-logit, which has `add_max_logit(layer, max_logit)`).

Observers see the unpruned heads (attnkit.attention.call.observed): a removed head with q = k = 0, its max logit
NaN. On a decoder, an observer of q and k is called only when it has a true attribute `decoder_arguments`, with the
op's decoder arguments as keywords (causal, kv_head, sliding_window, softcap, sink, symmetric_window; k then with its
KV heads); the others are refused by name. ModernBERT's local layers pass the window arguments too, so they count as
such a layer here. An observer with a true attribute `two_sequences` also takes an encoder–decoder's cross-attention
(the keyword `key_lengths`: the source's lengths, `lengths` then the target's) and T5's position bias (`bias`, as
attnkit.reference.attention_weights takes them); the others are refused by name there. Observers take whole
sequences: a step of generation with a KV cache is refused."""
from __future__ import annotations

from ...arch.pruning import to_unpruned
from ...errors import AttnkitError
from ..call import AttentionCall
from .base import BaseConsumer, Result, Wants


def _refuse_steps(call: AttentionCall) -> None:
    if call.decode:
        raise AttnkitError("observers of q and k (e.g. JS distances) take whole sequences, not a step of "
                           "generation with a KV cache: run the forward without past_key_values")


def _refuse_two_sequences(call: AttentionCall, observer) -> None:
    if (call.cross or call.bias is not None) and not getattr(observer, "two_sequences", False):
        raise AttnkitError(f"observers of q and k (e.g. JS distances) compute self-attention from q and k alone, but "
                           f"layer {call.layer} is {'cross-attention' if call.cross else 'given an additive bias (T5)'}"
                           ": this analysis does not support encoder–decoders yet")


class QKObserver(BaseConsumer):
    """Calls `observer(layer, query, key, lengths, scaling[, **decoder arguments])` before the op."""

    role = "observer"

    def __init__(self, observer):
        self.observer = observer

    def wants(self, call: AttentionCall) -> Wants | None:
        _refuse_steps(call)
        _refuse_two_sequences(call, self.observer)
        return Wants()

    def before(self, call: AttentionCall) -> None:
        obs = self.observer
        q, k, dec = call.observed
        if call.cross:
            dec = {**dec, "key_lengths": call.key_lengths}
        if call.bias is not None:  # T5's position bias, over the unpruned heads as q and k are
            dec = {**dec, "bias": call.bias if call.kept is None else to_unpruned(call.bias, call.kept)}
        if not dec:
            obs(call.layer, q, k, call.lengths, call.scaling)
        elif getattr(obs, "decoder_arguments", False):  # it computes a decoder's attention as the op does
            obs(call.layer, q, k, call.lengths, call.scaling, **dec)
        else:
            name = getattr(obs, "__qualname__", type(obs).__name__)
            raise AttnkitError(
                f"an observer of q and k ({name}) does not take a decoder's attention arguments (causal, KV "
                "heads, sliding window, soft cap, sink): it would measure attention this model does not "
                "compute, so this analysis does not support decoder models (nor ModernBERT's windowed layers) yet")


class MaxLogitObserver(BaseConsumer):
    """Gives `observer.add_max_logit(layer, B×H max logits)` after the op (computed in the same call)."""

    role = "observer"

    def __init__(self, observer):
        self.observer = observer

    def wants(self, call: AttentionCall) -> Wants | None:
        _refuse_steps(call)
        return Wants(max_logit=True)

    def after(self, call: AttentionCall, result: Result) -> None:
        ml = result.max_logit
        self.observer.add_max_logit(call.layer, ml if call.kept is None else to_unpruned(ml, call.kept, float("nan")))


def observer_consumer(observer) -> QKObserver | MaxLogitObserver:
    """The consumer of an observer: MaxLogitObserver when it `takes_max_logit`, else QKObserver."""
    return MaxLogitObserver(observer) if getattr(observer, "takes_max_logit", False) else QKObserver(observer)
