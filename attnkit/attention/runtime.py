"""What an instrumented model carries for its attention: the `Runtime` (settings, the consumers attached, what the
blocks open on it give the next forwards, the stack of forwards under way), and `LayerPart`, what an intervention
does to one layer.

The Runtime holds no per-consumer field: what is done with the op's results is a consumer
(attnkit/attention/consumers/) attached for a block with `attach` and taken off with `detach`. It holds no
per-forward field either: a forward's own data (its inputs, attnkit's batch, the sentence ids, the intervention) is
read once when it begins into a `Forward` (attnkit/attention/context.py), which its calls of the attention function
read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass, field

import torch

from ..arch.pruning import to_kept
from ..errors import AttnkitError
from ..features import DEFAULT_NUM_WINDOWS
from .context import NOTHING_GIVEN, BatchInfo, Forward, Given, ModelInputs, ReadsGiven

# The attribute of an instrumented model, its base model and its attention modules that holds their Runtime
# (attached by attnkit.models.instrument; a deep copy of the model carries its own).
RUNTIME_ATTR = "_attnkit_runtime"

_giving = threading.Lock()  # `Runtime.give` from any thread (blocks may be entered by several)


@dataclass
class LayerPart:
    """What the attention of one layer does to samples `start` … `stop` − 1 of a forward: the op's per-head mode,
    region and gates codes (None: unchanged), renormalize, and `outputs`, head → the tensor that replaces the
    head's output after the op (patch and mean; broadcast to the samples × tokens × head size). An intervention's
    `layer_plan` gives one part for the whole batch, stacked interventions one per block of samples."""

    start: int
    stop: int
    mode: torch.Tensor | None = None
    region: torch.Tensor | None = None
    gates: torch.Tensor | None = None
    renormalize: bool = False
    outputs: dict = field(default_factory=dict)


def kept_part(p: LayerPart, kept, layer: int) -> LayerPart:
    """`p` for a pruned layer that kept the heads `kept` (attnkit/arch/pruning.py): the per-head codes and the
    replaced outputs of those heads, renumbered as the layer numbers them. Codes of removed heads drop out (a
    removed head is a zeroed head); a patch or mean value for one is refused, as it would silently do nothing."""
    index = {h: i for i, h in enumerate(kept[0])}
    gone = sorted(h for h in p.outputs if h not in index)
    if gone:
        raise AttnkitError(f"head L{layer}H{gone[0]} was pruned from this model: it has no output to patch or "
                           "replace by its mean")
    return LayerPart(p.start, p.stop, to_kept(p.mode, kept), to_kept(p.region, kept), to_kept(p.gates, kept),
                     p.renormalize, {index[h]: v for h, v in p.outputs.items() if h in index})


@dataclass
class Runtime(ReadsGiven):
    """Per-model state read by the attention function: settings, the consumers of the op's results, what the blocks
    open on the model give the next forwards (`given`), and the forwards under way (`forwards`, innermost last)."""

    backend: str = "auto"
    num_windows: int = DEFAULT_NUM_WINDOWS
    # what is done with the op's results, in the order attached (attnkit/attention/consumers/)
    consumers: list = field(default_factory=list)
    given: Given = NOTHING_GIVEN  # read by each forward when it begins (`enter_forward`)
    separator_ids: tuple[int, ...] = ()  # sep/eos token ids, to find segments in input_ids
    sink: bool = False  # the model has a learned sink logit per head: its features end with `sink`
    segment_types: bool = True  # whether token_type_ids mark segments (the model has > 1 type)
    # a vision transformer's ImageLayout (attnkit/attention/positions.py): a setting of the model, read from its
    # config at attnkit.instrument; the size of one forward's image is that forward's (ModelInputs.image_size)
    image: object | None = None
    # an encoder–decoder: every layer's features end with the alignment features (docs/features.md, "Alignment
    # features"), so that encoder, decoder and cross heads share one feature axis
    alignment: bool = False
    forwards: list = field(default_factory=list)  # the Forward of each forward under way (nested calls), innermost last

    def give(self, **changes) -> None:
        """Change what the next forwards get (the fields of `Given` named; the others stay): the forwards under way
        keep what they began with."""
        with _giving:
            self.given = dataclasses.replace(self.given, **changes)

    def enter_forward(self, inputs: ModelInputs) -> Forward:
        """A forward of the model begins with `inputs`: its Forward, with what is given now, goes on the stack."""
        forward = Forward(inputs, self.given)
        self.forwards.append(forward)
        return forward

    def exit_forward(self) -> None:
        """The innermost forward under way ends (nothing when none is)."""
        if self.forwards:
            self.forwards.pop()

    def context(self) -> Forward:
        """The Forward that a call of the attention function belongs to: the innermost forward under way, else (a
        layer run outside a forward of the model) one with no inputs seen and what is given now."""
        return self.forwards[-1] if self.forwards else Forward(None, self.given)

    @contextlib.contextmanager
    def closing_forwards(self):
        """When the block ends, however it ends, the forwards of the model begun inside it that are still open are
        exited. attnkit.models exits a forward in a forward hook with `always_call`, which torch runs for an Exception
        but not for a KeyboardInterrupt (nor any other BaseException): without this, Ctrl-C inside a forward leaves
        that forward on the runtime. Every block attnkit puts on a model (consumers, interventions) is one."""
        depth = self.open_forwards
        try:
            yield self
        finally:
            self.exit_forwards(depth)

    @property
    def open_forwards(self) -> int:
        """How many forwards of the model are under way (entered and not yet exited)."""
        return len(self.forwards)

    def exit_forwards(self, depth: int) -> None:
        """Exit the forwards open above `depth` (`open_forwards` when the caller began)."""
        while len(self.forwards) > depth:
            self.exit_forward()

    def attach(self, consumer):
        """Add `consumer` (attnkit.attention.consumers.Consumer) after those attached; returns it."""
        self.consumers.append(consumer)
        return consumer

    def detach(self, consumer) -> None:
        self.consumers.remove(consumer)

    @contextlib.contextmanager
    def attached(self, consumer):
        """`consumer` attached for the block, and always detached again (with the forwards it left open closed)."""
        self.attach(consumer)
        try:
            with self.closing_forwards():
                yield consumer
        finally:
            self.detach(consumer)

    def _of_role(self, role: str) -> list:
        return [c for c in self.consumers if getattr(c, "role", None) == role]

    @property
    def observers(self) -> list:
        """The observers of q and k and of the max logit attached (attnkit.models.observing), in order."""
        return [c.observer for c in self._of_role("observer")]

    @property
    def tracker(self):
        """The attnkit.training.Tracker attached (attnkit.track), or None."""
        found = self._of_role("tracker")
        return found[0].tracker if found else None

    @property
    def features(self):
        """layer → the features of the forward under way (a dict, or a LayerFeatures): those of the extraction
        consumer attached (attnkit.engine.forward.measuring); {} without one."""
        found = self._of_role("features")
        return found[-1].store if found else {}

    @features.setter
    def features(self, store) -> None:
        self._measuring("features").store = store

    @property
    def weighting(self) -> str:
        """How extraction's features are weighted ("attention", or "norm": docs/features.md): the extraction
        consumer's; "attention" without one."""
        found = self._of_role("features")
        return found[-1].weighting if found else "attention"

    @weighting.setter
    def weighting(self, weighting: str) -> None:
        self._measuring("weighting").weighting = weighting

    @property
    def out_proj(self) -> dict:
        """layer → the output projection that norm weighting reads (the extraction consumer's)."""
        found = self._of_role("features")
        return found[-1].out_proj if found else {}

    @out_proj.setter
    def out_proj(self, out_proj: dict) -> None:
        self._measuring("out_proj").out_proj = out_proj

    def _measuring(self, what: str):
        found = self._of_role("features")
        if not found:
            raise AttnkitError(f"{what} is set only inside attnkit.engine.forward.measuring(model)")
        return found[-1]

    @property
    def stop_when_measured(self) -> bool:
        """Whether the forward ends once every layer's features are in (attnkit.engine.forward.forward_features)."""
        return bool(self._of_role("early_stop"))

    @contextlib.contextmanager
    def batch_of(self, batch):
        """Within the block, the forwards that begin use `batch`'s lengths, token classes and sentence ids (an
        `attnkit.tokens.Batch`, or a BatchInfo, on the model's device; an encoder–decoder's also those of its
        `target`); afterwards none."""
        target = getattr(batch, "target", None)
        self.give(batch=BatchInfo(batch.lengths, batch.token_class, batch.sentence_id,
                                  None if target is None else BatchInfo(target.lengths, target.token_class,
                                                                        target.sentence_id)))
        try:
            yield self
        finally:
            self.give(batch=None)


class Callers(list):
    """The modules that called attnkit attention, in call order; `sink`: whether one of them has a learned sink
    logit per head (gpt-oss), which adds the feature `sink` (docs/features.md)."""

    sink: bool = False


_callers: Callers | None = None  # while `recording_callers` runs: the modules that called attnkit attention


@contextlib.contextmanager
def recording_callers():
    """Yield a `Callers` list that collects, in call order, the modules that call attnkit attention inside the
    block (`attnkit.models.instrument` runs its probe forward under it)."""
    global _callers
    _callers = seen = Callers()
    try:
        yield seen
    finally:
        _callers = None


def recording() -> bool:
    """Whether `recording_callers` runs (the probe forward of attnkit.models.instrument)."""
    return _callers is not None


def note_caller(module, sink: bool) -> None:
    """Record `module` (and whether it has a sink logit) when `recording_callers` runs."""
    if _callers is not None:
        _callers.append(module)
        _callers.sink = _callers.sink or sink
