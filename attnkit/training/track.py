"""Per-head statistics while a model trains (docs/training.md, "Statistics while training").

    with attnkit.track(model, features=("entropy", "max_logit", "cls")) as tracker:
        for step, batch in enumerate(loader):
            loss = model(**batch).loss
            loss.backward(); opt.step(); opt.zero_grad()
            if step % 100 == 0:
                stats = tracker.read()      # {"entropy": layers × heads, ...} on the model's device

Every forward of the model inside the block adds its statistics to sums kept on the device: the op computes the
features in the same call that computes the output (attnkit/attention/consumers/tracker.py), and so does the
max logit where the kernel measures it (the fused CPU op; elsewhere a blocked q·kᵀ pass, attnkit.kernels.statistics,
only when it is asked for). Nothing is read on the host:
`read()` returns device tensors (moving them to the host is the caller's one sync).
"""
from __future__ import annotations

import contextlib

import torch

from ..arch.pruning import to_unpruned
from ..attention.consumers import Tracking
from ..errors import AttnkitError, check_int
from ..features import DEFAULT_NUM_WINDOWS
from ..models import attention_modules, instrument, model_feature_names, runtime_of
from .checks import feature_list, model_to_track

MAX_LOGIT = "max_logit"
DEFAULT_FEATURES = ("entropy", MAX_LOGIT, "cls")


class Tracker:
    """Sums of per-head statistics since the last `read()`, per layer, on the device.

    A feature of docs/features.md is a mean over the samples the model saw (each sample's value being the mean over
    its valid rows, as in extraction); `max_logit` is the maximum over them (docs/features.md, "Max logit")."""

    def __init__(self, n_layers: int, n_heads: int, names: list[str], features: tuple[str, ...], device=None,
                 num_windows: int = DEFAULT_NUM_WINDOWS):
        self.n_layers, self.n_heads, self.num_windows = n_layers, n_heads, num_windows
        self.features = tuple(features)
        self._index = [names.index(f) for f in self.features if f != MAX_LOGIT]
        self._mean_names = [f for f in self.features if f != MAX_LOGIT]
        self.want_max = MAX_LOGIT in self.features
        self.device = device
        self.release_if_left = None  # AttnkitCallback's: lets go of a tracker its training left when it raised
        self._paused = False
        self._reset()

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside this block add nothing (e.g. an evaluation between training steps)."""
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    def _reset(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}
        self._counts: dict[int, int] = {}
        self._max: dict[int, torch.Tensor] = {}
        self.samples = 0  # samples seen by the first layer since the last read

    def record(self, layer: int, feats: torch.Tensor, max_logit: torch.Tensor | None, kept) -> None:
        """Called by attnkit attention for every layer of every forward: B×h×F features of the heads the layer has
        (`kept`: a pruned layer's heads) and, when `max_logit` is tracked, their B×h max logits from the same call
        of the op (attnkit.ops.attention(..., want_max_logit=True))."""
        if torch.compiler.is_compiling():
            raise AttnkitError("attnkit.track does not run inside torch.compile: track the uncompiled model, or "
                               "compile it without attnkit.track")
        if self._paused or torch._C._current_graph_task_id() != -1:
            return  # paused, or a forward re-run by gradient checkpointing inside backward (counted once)
        # normal tensors even when the forward runs under inference mode (an evaluation inside the block)
        with torch.inference_mode(False), torch.no_grad():
            f = feats[..., self._index].float()
            if kept is not None:
                f = to_unpruned(f, kept, float("nan"))
            s = f.sum(0)
            if layer in self._sums:
                self._sums[layer] += s
                self._counts[layer] += f.shape[0]
            else:
                self._sums[layer], self._counts[layer] = s, f.shape[0]
            if layer == 0:
                self.samples += f.shape[0]
            if self.want_max:
                m = max_logit.amax(0)
                if kept is not None:
                    m = to_unpruned(m[None], kept, float("nan"))[0]
                self._max[layer] = m if layer not in self._max else torch.maximum(self._max[layer], m)

    def read(self, features=None, reset: bool = True) -> dict[str, torch.Tensor]:
        """{feature: layers × heads fp32 tensor} for `features` (None: all tracked ones): the mean since the last
        read of them (`max_logit`: the maximum), NaN for a layer no forward reached. No host sync. Reading resets
        what it read (the means together, the max logit on its own), unless `reset` is False."""
        names = feature_list(features, self.features)
        unknown = [f for f in names if f not in self.features]
        if unknown:
            raise AttnkitError(f"{unknown[0]!r} is not tracked here; tracked: {', '.join(self.features)}")
        sample = next(iter(self._sums.values()), None)
        dev = sample.device if sample is not None else (self.device or "cpu")
        nan = torch.full((self.n_heads,), float("nan"), device=dev)
        out = {}
        means = [name for name in names if name != MAX_LOGIT]
        if means:
            per_layer = [self._sums[i] / self._counts[i] if i in self._sums
                         else nan[:, None].expand(-1, len(self._index)) for i in range(self.n_layers)]
            stacked = torch.stack(per_layer) if per_layer else torch.zeros(0, self.n_heads, len(self._index))
            for name in means:
                out[name] = stacked[..., self._mean_names.index(name)]
        if MAX_LOGIT in names:
            out[MAX_LOGIT] = torch.stack([self._max.get(i, nan) for i in range(self.n_layers)])
        if reset:
            if means:
                self._sums, self._counts, self.samples = {}, {}, 0
            if MAX_LOGIT in names:
                self._max = {}
        return {f: out[f] for f in names}


def trackable_features(model, num_windows: int = DEFAULT_NUM_WINDOWS) -> list[str]:
    """The names `track` accepts for `model`: its features (docs/features.md; `sink` for a model with sink logits)
    and `max_logit`."""
    return model_feature_names(model, num_windows) + [MAX_LOGIT]


def new_tracker(model, features=DEFAULT_FEATURES, num_windows: int = DEFAULT_NUM_WINDOWS,
                purpose: str = "attnkit.track") -> Tracker:
    """A Tracker of `features` for `model` (switched to attnkit attention), every argument checked first
    (attnkit/training/checks.py): what `track` and `AttnkitCallback` build before anything runs."""
    model_to_track(model, purpose)
    features = feature_list(features, DEFAULT_FEATURES)
    num_windows = check_int(num_windows, "num_windows")
    instrument(model)
    names = model_feature_names(model, num_windows)
    unknown = [f for f in features if f != MAX_LOGIT and f not in names]
    if unknown:
        raise AttnkitError(f"{purpose} cannot track {unknown[0]!r}; known: {', '.join(names + [MAX_LOGIT])}")
    refuse_if_tracked(runtime_of(model))
    cfg = model.config
    n_heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0))
    device = next(model.parameters()).device
    return Tracker(len(attention_modules(model)), n_heads, names, features, device, num_windows=num_windows)


def refuse_if_tracked(rt) -> None:
    """An AttnkitError when the model of runtime `rt` is tracked, after letting go of a tracker that a training which
    raised left behind (`Tracker.release_if_left`, set by AttnkitCallback): that one is replaced, not refused."""
    release = getattr(rt.tracker, "release_if_left", None)
    if release is not None:
        release()
    if rt.tracker is not None:
        raise AttnkitError("this model is already tracked: nest no attnkit.track blocks (or AttnkitCallback "
                           "trainings) on one model")


@contextlib.contextmanager
def attached(model, tracker: Tracker):
    """Within the block every forward of `model` adds its statistics to `tracker`: the one place a tracker is
    attached to the model's runtime (attnkit.hf_attention reads `Runtime.tracker`) and detached again, whatever
    ends the block (any BaseException too)."""
    rt = runtime_of(model)
    refuse_if_tracked(rt)
    saved = rt.num_windows
    rt.num_windows = tracker.num_windows
    consumer = rt.attach(Tracking(tracker))  # attnkit/attention/consumers/tracker.py
    try:
        yield tracker
    finally:
        rt.detach(consumer)
        rt.num_windows = saved


@contextlib.contextmanager
def track(model, features=DEFAULT_FEATURES, *, num_windows: int = DEFAULT_NUM_WINDOWS):
    """Within the block, every forward of `model` (switched to attnkit attention if it is not) accumulates the
    per-head `features` (a name, a sequence of names; None: DEFAULT_FEATURES) on the device; yields the `Tracker`
    whose `read()` returns them (module docstring). However the block ends, KeyboardInterrupt included, the model
    is left untracked, with the forwards an interrupt left open exited (`Runtime.closing_forwards`)."""
    tracker = new_tracker(model, features, num_windows)
    with attached(model, tracker), runtime_of(model).closing_forwards():
        yield tracker
