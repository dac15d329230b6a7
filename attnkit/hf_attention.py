"""attnkit as a transformers 5 attention implementation (`attn_implementation="attnkit"`).

transformers calls `attnkit_attention(module, q, k, v, mask, scaling=..., dropout=...)` from every
self-attention layer. With nothing active it is plain attention (equal to eager). What extraction and
interventions need per forward — the batch's token classes and sentence ids, the intervention, where
to put features — lives in a `Runtime` that `attnkit.models.instrument` attaches to each attention
module; context managers in `attnkit.engine.forward` and `attnkit.interventions` fill it and always clear it
again.

Asked for maps (`model(**inputs, output_attentions=True)`, which transformers passes on to the attention
function), it also returns each layer's B×H×L×L weights, equal to eager attention's, and under an intervention
the weights the layer really used (after mode, region and renormalisation: `attnkit.reference.attention_weights`;
gates scale the head's output, not its weights). They are computed only then: a forward without
`output_attentions` materialises no map.

An intervention says per layer what the op does (`layer_plan` → `LayerPart`s): one call of the op for the batch,
or one per block of samples for stacked interventions; after the op, the outputs of patched and mean-ablated heads
are replaced (attnkit.reference.replace_head_outputs), and the per-head outputs go to the caches of `cache_heads`.

The mask function registered beside it hands over the 2-D padding mask (or None when a batch has no
padding) instead of an L×L bias, to encoders and causal models alike: the op takes per-sample lengths, never an
L×L tensor.

Decoder language models (docs/decoders.md): what transformers passes decides the op's decoder arguments
(`decoder_arguments`: the module's `is_causal`, K/V with fewer heads than Q, the `sliding_window`, `softcap` and
`s_aux` arguments); an argument attnkit does not know is refused by name. A left-padded batch is taken by moving
each sample's tokens to the front (`padding_of`, `rolled`), calling the op, and moving the results back; rows of
left padding get zeros.

Generation with a KV cache (docs/decoders.md, "Generation"): a step has fewer queries than keys, the queries being
the last positions of the keys (the op's definition: attnkit/reference.py, "Fewer queries than keys"). Without
padding the op gets them as they are. A left-padded batch (as `generate` pads) has its keys moved to the front and
its queries left where they are (each sample's last tokens); the samples of one length are one call of the op, with
that many keys. Interventions apply (their modes, gates, mean and patch values of the step's length); regions, which
need the sentence of every key, and observers of q and k are refused by name, as are attnkit's own batches.

Norm weighting (docs/features.md, "Norm-weighted features"): when the Runtime's `weighting` is "norm", each
layer's features describe its weights scaled per key by ‖f_h(x_t)‖ (attnkit/arch/norms.py), computed here from
the values this function receives and the layer's output projection; the output does not change.

A pruned layer (attnkit/arch/pruning.py) has fewer heads than the config names: its intervention codes and gates
are those of the heads it kept, and what attnkit measures is spread over the unpruned heads, so a removed head's
features are 0 (those of a zeroed head) and observers see it with q = k = 0. A layer with no head left calls this
function with empty q, k, v and gets an empty output.

Sentence ids (docs/features.md, "Token classes" and "Sentence ids") matter only to region interventions
(`no_intra`/`no_inter`). For each forward they come from, in this order:
1. attnkit's own batches (`extract`, `ablate`: `Runtime.batch_of`), computed by `attnkit.tokens.Encoder`;
2. ids the user gave (`attnkit.sentences(model, ids)` or `intervene(model, iv, sentences=ids)`), B×L;
3. the inputs of a plain forward, which hooks from `attnkit.models.instrument` record for its duration
   (`Runtime.inputs`), per sample: `token_type_ids` when they take more than one value over the sample's
   tokens (segments A and B of BERT, ELECTRA); else separator tokens in `input_ids`: a run of
   separators before the end closes a segment (RoBERTa's `</s></s>`, BERT's middle `[SEP]`), and with
   no such run the sample is a single text, one sentence; else (no separator token known for the
   model) `token_type_ids` that take one value: a single text again, as the tokenizer marks pairs.
Segments become sentences by `attnkit.tokens.sentence_ids` ([CLS] in the first, a [SEP] in the one it
closes). Where none of this applies — the forward's inputs were not seen, or a sample has neither
separating `token_type_ids` nor `input_ids` with a known separator token (e.g. `inputs_embeds`) — a
region intervention raises AttnkitError saying how to give the ids; it never runs as a silent no-op.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .arch.architectures import output_matrix
from .arch.norms import key_norms
from .arch.pruning import KV_HEAD_ATTR, kept_heads, to_kept, to_unpruned
from .errors import AttnkitError
from .features import CLS, DEFAULT_NUM_WINDOWS, num_features
from .ops import attention
from .reference import attention_weights, replace_head_outputs
from .tokens import sentence_ids as segment_sentence_ids

NAME = "attnkit"
# The attribute of an instrumented model, its base model and its attention modules that holds their Runtime
# (attached by attnkit.models.instrument; a deep copy of the model carries its own).
RUNTIME_ATTR = "_attnkit_runtime"


@dataclass
class BatchInfo:
    """What the op needs to know about the batch beyond q, k, v (on the model's device)."""

    lengths: torch.Tensor  # int64 B
    token_class: torch.Tensor | None = None  # int32 B×L
    sentence_id: torch.Tensor | None = None  # int32 B×L


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
class ModelInputs:
    """What the current forward of the instrumented model was given (recorded by attnkit.models' hooks)."""

    input_ids: torch.Tensor | None
    token_type_ids: torch.Tensor | None
    # whether the forward asked for attention maps: GPT-2's attention module takes `output_attentions` itself and
    # does not hand it on to the attention function
    output_attentions: bool = False
    sentence_id: torch.Tensor | None = None  # B×L int32, derived once per forward when first needed


class FeaturesComplete(Exception):
    """Raised by the attention function when every layer's features are in and the forward only measures
    (Runtime.stop_when_measured): the rest of the forward would compute what nobody reads."""


class LayerFeatures:
    """layer → the B×H×F features of the forward under way, written into one B × layers × H × F buffer.

    Why one buffer, made before the forward: a small tensor kept per layer until the forward ends is carved by
    glibc out of the hole a large freed activation left, so the next activation of that size no longer fits there
    and the heap grows instead (SmolLM2 at 8k tokens: 210 MB more than sdpa's forward, one 1 KB tensor per layer).
    `shape` (B, H, F) and `device`: the buffer is made here, before the forward's activations exist; None: at
    the first layer's features (also when they do not have that shape)."""

    def __init__(self, n_layers: int, shape: tuple | None = None, device=None):
        self.n_layers = n_layers
        self._buffer = None if shape is None else torch.empty((shape[0], n_layers, *shape[1:]), device=device)
        self._written = [False] * n_layers  # a list made here: a set would grow (reallocate) mid-forward

    def __setitem__(self, layer: int, feats: torch.Tensor) -> None:
        if not 0 <= layer < self.n_layers:
            raise AttnkitError(f"features of layer {layer}, but the model has {self.n_layers} attention layers")
        fits = self._buffer is not None and self._buffer[:, layer].shape == feats.shape
        if not fits and not any(self._written):
            self._buffer = feats.new_empty((feats.shape[0], self.n_layers, *feats.shape[1:]))
        elif not fits:
            raise AttnkitError(f"layer {layer} produced features of shape {tuple(feats.shape)}, the layers before "
                               f"{tuple(self._buffer[:, layer].shape)}: attnkit needs the same heads in every layer")
        self._buffer[:, layer] = feats
        self._written[layer] = True

    def __contains__(self, layer: int) -> bool:
        return 0 <= layer < self.n_layers and self._written[layer]

    def complete(self) -> bool:
        """Whether every layer's features are in."""
        return all(self._written)

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self:
            raise KeyError(layer)
        return self._buffer[:, layer]

    def stacked(self) -> torch.Tensor:
        """B × layers × H × F (every layer written: the caller checks with `in`)."""
        return self._buffer


@dataclass
class Runtime:
    """Per-model state read by the attention function during a forward pass."""

    backend: str = "auto"
    num_windows: int = DEFAULT_NUM_WINDOWS
    want_features: bool = False
    # "attention", or "norm": features from the weights scaled by ‖f_h(x_t)‖ (docs/features.md), which needs the
    # output projection of every layer (`out_proj`: layer → nn.Linear, set by attnkit.engine.forward.measuring)
    weighting: str = "attention"
    out_proj: dict = field(default_factory=dict)
    batch: BatchInfo | None = None
    intervention: object | None = None  # attnkit.interventions.Intervention (or StackedInterventions)
    # layer -> B×H×F tensor, filled during forward (attnkit.engine.forward.forward_features: a LayerFeatures)
    features: dict | LayerFeatures = field(default_factory=dict)
    # Callables (layer, query, key, lengths, scaling) for statistics that need q and k themselves,
    # e.g. the Jensen-Shannon distances between heads. On a decoder only those with a true attribute
    # `decoder_arguments` are called, with the op's decoder arguments as keywords (causal, kv_head, sliding_window,
    # softcap, sink: `observed`; k then with its KV heads); the others are refused by name.
    observers: list[Callable] = field(default_factory=list)
    calls: int = 0
    sentences: torch.Tensor | None = None  # user-given B×L sentence ids (attnkit.sentences)
    inputs: ModelInputs | None = None  # the inputs of the forward under way, None outside one
    separator_ids: tuple[int, ...] = ()  # sep/eos token ids, to find segments in input_ids
    sink: bool = False  # the model has a learned sink logit per head: its features end with `sink`
    segment_types: bool = True  # whether token_type_ids mark segments (the model has > 1 type)
    _outer_inputs: list = field(default_factory=list)  # inputs of enclosing forwards (nested calls)
    # True inside attnkit.engine.forward.forward_features, which reads only the features: the forward ends (the
    # attention function raises FeaturesComplete) once every layer's are in, and what follows the last attention
    # layer (its output projection and MLP, the final norm) does not run
    stop_when_measured: bool = False
    # attnkit.caching.HeadCache objects that keep each layer's per-head outputs (attnkit.cache_heads)
    head_caches: list = field(default_factory=list)
    # attnkit.training.Tracker (attnkit.track): per-head statistics of every forward, accumulated on the device
    tracker: object | None = None

    def enter_forward(self, inputs: ModelInputs) -> None:
        self._outer_inputs.append(self.inputs)
        self.inputs = inputs

    def exit_forward(self) -> None:
        self.inputs = self._outer_inputs.pop() if self._outer_inputs else None

    @property
    def active(self) -> bool:
        return self.want_features or self.intervention is not None or bool(self.observers) or bool(self.head_caches)

    @contextlib.contextmanager
    def batch_of(self, batch):
        """Within the block, forwards use `batch`'s lengths, token classes and sentence ids
        (an `attnkit.tokens.Batch` on the model's device)."""
        self.batch = BatchInfo(batch.lengths, batch.token_class, batch.sentence_id)
        try:
            yield self
        finally:
            self.batch = None


class Callers(list):
    """The modules that called attnkit attention, in call order; `sink`: whether one of them has a learned sink
    logit per head (gpt-oss), which adds the feature `sink` (docs/features.md)."""

    sink: bool = False


_callers: Callers | None = None  # while `recording_callers` runs: the modules that called attnkit attention
_last_mask: tuple = (lambda: None, None)


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


def lengths_from_mask(mask: torch.Tensor | None, B: int, L: int, device) -> torch.Tensor:
    """Per-sample lengths (int64, on the mask's device) from a 2-D padding mask; insists on right
    padding (1…1 0…0) and at least one token per sample.

    The same mask object reaches every layer of a forward, so the lengths are computed and checked once
    per forward. Checking needs the mask's values: in an eager forward (CPU, or CUDA outside graph
    capture: one host sync per new mask) a bad mask raises AttnkitError. Under torch.compile, or while
    a CUDA graph is being captured, nothing is read on the host (the lengths stay on the device): the
    check becomes a device-side assertion (torch._assert_async), so a bad mask then fails the run
    with an assertion instead of an AttnkitError. Run a batch eagerly before capturing a graph.
    """
    global _last_mask
    if mask is None:
        return torch.full((B,), L, dtype=torch.int64, device=device)
    if mask.dim() != 2 or mask.shape != (B, L):
        raise AttnkitError(
            f"attnkit attention needs a 2-D padding mask of shape (batch, length) = ({B}, {L}); "
            f"got shape {tuple(mask.shape)} (pass the tokenizer's attention_mask, not a prepared 4-D mask)"
        )
    compiling = torch.compiler.is_compiling()
    if not compiling and _last_mask[0]() is mask:
        return _last_mask[1]
    m = mask.bool()
    lengths = m.sum(-1)
    right_padded = (m == (torch.arange(L, device=m.device)[None, :] < lengths[:, None])).all()
    non_empty = (lengths > 0).all()
    if compiling or (m.is_cuda and torch.cuda.is_current_stream_capturing()):
        torch._assert_async(right_padded & non_empty,
                            "attnkit attention needs right-padded batches with at least one token per sample")
        return lengths
    ok_padding, ok_non_empty = torch.stack([right_padded, non_empty]).tolist()  # one host read
    if not ok_padding:
        raise AttnkitError("attnkit attention needs right-padded batches (padding_side='right')")
    if not ok_non_empty:
        raise AttnkitError("a sample in the batch has no unmasked token")
    _last_mask = (weakref.ref(mask), lengths)
    return lengths


_last_layout: tuple = (lambda: None, None)


def padding_of(mask: torch.Tensor | None, B: int, L: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lengths, offsets) of a batch whose samples are right- or left-padded: each sample's tokens are one run of
    ones in the 2-D mask, starting at `offsets[b]` (int64 B; None when every sample starts at 0, i.e. the batch is
    right-padded). A mask whose ones are not one run (1 0 1) is refused. While compiling or capturing a CUDA graph
    only right padding is taken (lengths_from_mask: a device-side assertion), as finding offsets needs the host."""
    global _last_layout
    if mask is None or torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return lengths_from_mask(mask, B, L, device), None
    if _last_layout[0]() is mask:
        return _last_layout[1]
    if mask.dim() != 2 or mask.shape != (B, L):
        return lengths_from_mask(mask, B, L, device), None  # its message names the shape
    m = mask.bool()
    lengths = m.sum(-1)
    offsets = torch.where(lengths > 0, m.int().argmax(-1), 0)
    pos = torch.arange(L, device=m.device)[None, :]
    one_run = (m == ((pos >= offsets[:, None]) & (pos < (offsets + lengths)[:, None]))).all()
    ok_run, ok_non_empty, shifted = torch.stack([one_run, (lengths > 0).all(), (offsets > 0).any()]).tolist()
    if not ok_run:
        raise AttnkitError("attnkit attention needs each sample's tokens in one run: right- or left-padded batches "
                           "(the attention mask has a 0 between two 1s)")
    if not ok_non_empty:
        raise AttnkitError("a sample in the batch has no unmasked token")
    result = (lengths, offsets if shifted else None)
    _last_layout = (weakref.ref(mask), result)
    return result


def rolled(t: torch.Tensor, offsets: torch.Tensor, dim: int, back: bool = False) -> torch.Tensor:
    """Each sample b of `t` (samples on axis 0) rolled along `dim` so that position offsets[b] comes first
    (`back`: the inverse, the first position goes back to offsets[b]). Left padding becomes right padding: the
    sample's tokens move to the front, its padding behind them."""
    L = t.shape[dim]
    sign = -1 if back else 1
    idx = (torch.arange(L, device=t.device)[None, :] + sign * offsets.to(t.device)[:, None]) % L  # B × L
    shape = [1] * t.dim()
    shape[0], shape[dim] = t.shape[0], L
    return torch.gather(t, dim, idx.view(shape).expand(t.shape))


def _segments_by_separators(ids: list[int], separators) -> list:
    """Segment of each token (None for a separator): a run of separators followed by more tokens
    closes a segment, so `<s> A </s></s> B </s>` and `[CLS] A [SEP] B [SEP]` have segments 0 and 1."""
    seq, segment, after_separator = [], 0, False
    for tok in ids:
        if tok in separators:
            seq.append(None)
            after_separator = True
            continue
        if after_separator:
            segment += 1
            after_separator = False
        seq.append(segment)
    return seq


def sentence_ids_from_inputs(input_ids, token_type_ids, lengths: list[int], L: int, separator_ids) -> torch.Tensor:
    """B×L int32 sentence ids from a forward's inputs (rule 3 of the module docstring); padding gets 0.
    `token_type_ids` None: none given, or the model's token types mark no segments. Raises
    AttnkitError naming the first sample where no sentence structure can be found."""
    separators = set(separator_ids)
    out = torch.zeros((len(lengths), L), dtype=torch.int32)
    for b, n in enumerate(lengths):
        types = None if token_type_ids is None else token_type_ids[b, :n].tolist()
        ids = None if input_ids is None else input_ids[b, :n].tolist()
        if types is not None and len(set(types)) > 1:
            seq = types
        elif ids is not None and separators:
            seq = _segments_by_separators(ids, separators)
        elif types is not None:
            seq = types  # one type: a single text, as the tokenizer gives a pair's segments two types
        elif ids is None:
            raise AttnkitError(
                f"region interventions need sentence ids, but sample {b} of this forward has no token_type_ids "
                "that separate segments and no input_ids (inputs_embeds) to find separator tokens in: "
                + _HOW_TO_GIVE)
        else:
            raise AttnkitError(
                f"region interventions need sentence ids, but sample {b} of this forward has no token_type_ids "
                "that separate segments and the model names no separator token (attnkit.instrument(model, "
                "tokenizer=tokenizer) tells it): " + _HOW_TO_GIVE)
        out[b, :n] = torch.tensor(segment_sentence_ids(ids or [0] * n, seq), dtype=torch.int32)
    return out


_HOW_TO_GIVE = "give them with attnkit.sentences(model, ids) or attnkit.intervene(model, iv, sentences=ids)"


def forward_sentence_ids(rt: Runtime, B: int, L: int, lengths: torch.Tensor, device,
                         offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Sentence ids for a forward without an attnkit batch: the user's, else from the model's inputs. With
    `offsets` (a left-padded batch, see `padding_of`) they are those of the samples moved to the front."""
    if rt.sentences is not None:
        given = rt.sentences.to(device)
        return given if offsets is None else rolled(given, offsets, 1)
    inputs = rt.inputs
    if inputs is None or any(t is not None and tuple(t.shape) != (B, L)
                             for t in (inputs.input_ids, inputs.token_type_ids)):
        raise AttnkitError(
            "region interventions need sentence ids, but attnkit did not see this forward's inputs "
            "(attention ran outside a forward of the instrumented model): " + _HOW_TO_GIVE)
    if inputs.sentence_id is None:
        types = inputs.token_type_ids if rt.segment_types else None
        ids = inputs.input_ids
        if offsets is not None:  # the samples' tokens at the front, as the op sees them
            ids, types = (None if t is None else rolled(t, offsets.to(t.device), 1) for t in (ids, types))
        inputs.sentence_id = sentence_ids_from_inputs(ids, types, lengths.tolist(), L, rt.separator_ids)
    inputs.sentence_id = inputs.sentence_id.to(device)
    return inputs.sentence_id


def check_sentences_shape(rt: Runtime, B: int, L: int) -> None:
    if rt.sentences is not None and tuple(rt.sentences.shape) != (B, L):
        raise AttnkitError(
            f"attnkit.sentences gave sentence ids of shape {tuple(rt.sentences.shape)}, but the model got a "
            f"batch of {B} × {L} tokens: give one id per token of the padded batch")


# The keyword arguments transformers passes to an attention function besides `scaling` and `dropout`: those attnkit
# reads, and those that do not change what attention computes (positions are already in q and k; caches, router
# logits, the loss's token count and return flags are the model's business; DistilBERT hands the model's inputs on
# to its attention function, so `token_type_ids` the tokenizer made arrive there, where no attention implementation
# reads them: segments reach attnkit through the recorded inputs, `Runtime.inputs`). Any other argument that has a
# value is refused by name: it might change attention, and attnkit would silently ignore it.
READ_KWARGS = frozenset({"output_attentions", "is_causal", "sliding_window", "softcap", "s_aux"})
HARMLESS_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_router_logits",
                             "output_hidden_states", "return_dict", "past_key_values", "position_embeddings",
                             "token_type_ids", "num_items_in_batch"})


def decoder_arguments(module, H: int, Hkv: int, kwargs: dict, kept, device) -> dict:
    """The op's decoder arguments (docs/decoders.md, "What attnkit reads from transformers") for one call of the
    attention function: `causal` from the module's `is_causal` (or an `is_causal` argument), `sliding_window`
    and `softcap` from the arguments of the same names, `sink` from gpt-oss's `s_aux`, `kv_head` where the module
    names one (KV_HEAD_ATTR). Only what differs from the op's defaults is returned: an encoder gets {}. An
    argument attnkit does not know is refused by name (READ_KWARGS, HARMLESS_KWARGS)."""
    unknown = sorted(k for k, v in kwargs.items() if k not in READ_KWARGS and k not in HARMLESS_KWARGS
                     and v is not None)
    name = type(module).__name__
    if unknown:
        raise AttnkitError(f"{name} passes {unknown[0]!r} to its attention function, which attnkit does not know: it "
                           "may change what attention computes, so attnkit refuses it rather than ignore it")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False)) if causal is None else bool(causal)
    out: dict = {"causal": True} if causal else {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if not causal:
            raise AttnkitError(f"{name} asks for a sliding window of {window} tokens in bidirectional attention; "
                               "attnkit's sliding windows are causal (row s sees keys s − W < t ≤ s)")
        out["sliding_window"] = int(window)
    if kwargs.get("softcap") is not None:
        out["softcap"] = float(kwargs["softcap"])
    sink = kwargs.get("s_aux")
    if sink is not None:
        # not detached: a model in training learns its sink logits through the op's backward (attnkit.ops)
        sink = sink.to(device, torch.float32)
        # pruning keeps the sink logits of the heads kept; a layer that names them for the unpruned heads gets those
        out["sink"] = sink if kept is None or sink.shape[0] == H else to_kept(sink, kept)
    kv_head = getattr(module, KV_HEAD_ATTR, None)
    if kv_head is not None:
        out["kv_head"] = kv_head.to(device, torch.int32)
    elif Hkv != H and (Hkv == 0 or H % Hkv):
        raise AttnkitError(f"{name} has {H} query heads and {Hkv} KV heads, which do not form even groups, and "
                           f"names no KV head of each query head ({KV_HEAD_ATTR})")
    return out


def kv_index(H: int, Hkv: int, dec: dict, device) -> torch.Tensor | None:
    """The KV head of each query head (int64 H), or None when there is one KV head per query head."""
    if "kv_head" in dec:
        return dec["kv_head"].long()
    if Hkv == H:
        return None
    return torch.arange(H, device=device) // (H // Hkv)


def observed(query, key, kept, dec: dict) -> tuple:
    """(q, k, decoder arguments) as observers see them: the unpruned heads, a removed head with q = 0 (and, where
    K/V have a head per query head, k = 0). Where the layer's query heads read shared KV heads, k keeps its KV heads
    and `kv_head` maps every unpruned query head (a removed one to KV head 0). An encoder's observers get no
    decoder arguments (dec is {}), so observers written for encoders keep working."""
    if kept is None:
        return query, key, dec
    q = to_unpruned(query, kept)
    H, Hkv = query.shape[1], key.shape[1]
    if Hkv == H and "kv_head" not in dec:
        return q, to_unpruned(key, kept), dec
    index = kv_index(H, Hkv, dec, query.device)
    full = torch.zeros(kept[1], dtype=torch.int32, device=query.device)
    full[list(kept[0])] = (torch.arange(H, device=query.device) if index is None else index).to(torch.int32)
    dec = dict(dec, kv_head=full)
    if "sink" in dec:
        dec["sink"] = to_unpruned(dec["sink"][None], kept)[0]
    return q, key, dec


def per_query_head(value: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """B × Hkv × L × D values as B × H × L × D, each query head with its KV head's (a copy; only for what needs
    them per query head: norm weighting, and the maps path of training)."""
    return value if index is None else value.index_select(1, index)


def unshift(t: torch.Tensor, offsets: torch.Tensor, dims, row_dim: int, first_row: int = 0) -> torch.Tensor:
    """A result computed on left padding moved to the front (`rolled`) put back in the batch's own positions
    along `dims`; the rows of padding (`row_dim`, whose positions `first_row` + i lie below offsets[b]) are 0. A
    KV-cache step's rows were not moved (they are the batch's last positions, `first_row` = keys − queries)."""
    for d in dims:
        t = rolled(t, offsets, d, back=True)
    L = t.shape[row_dim]
    pad = first_row + torch.arange(L, device=t.device)[None, :] < offsets.to(t.device)[:, None]
    shape = [1] * t.dim()
    shape[0], shape[row_dim] = t.shape[0], L
    return t.masked_fill(pad.view(shape), 0)


def first_token_classes(B: int, L: int, device) -> torch.Tensor:
    """B×L token classes for a forward without attnkit's own batch (attnkit.track): the first token of each sample
    is CLS (after left padding is moved to the front, position 0 holds it), every other token OTHER, so the feature
    `cls` is each row's weight on the first token (a decoder's BOS or attention sink)."""
    classes = torch.zeros(B, L, dtype=torch.int32, device=device)
    classes[:, 0] = CLS
    return classes


def attnkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if _callers is not None:
        _callers.append(module)
    B, H, L, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if Lk < L:
        raise AttnkitError(
            f"attnkit attention computes self-attention over one sequence, but got {L} queries and {Lk} keys: "
            "cross-attention is not supported")
    # a step of generation with a KV cache: the L queries are the last L of the Lk keys (attnkit/reference.py)
    decode = Lk > L
    if torch.is_autocast_enabled(query.device.type):  # mixed precision: attention in the autocast dtype, as eager's
        # matmuls run under autocast (q and k may arrive in fp32 from the rotary embedding, v in the autocast dtype)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    rt: Runtime | None = getattr(module, RUNTIME_ATTR, None)
    # model(..., output_attentions=True): return the maps (transformers passes the flag on, except GPT-2's module)
    want_maps = bool(kwargs.get("output_attentions")) or bool(rt is not None and rt.inputs is not None
                                                              and rt.inputs.output_attentions)
    kept = kept_heads(module)  # a pruned layer: its heads in the unpruned numbering (attnkit/arch/pruning.py)
    dec = decoder_arguments(module, H, Hkv, kwargs, kept, query.device)
    if _callers is not None and "sink" in dec:
        _callers.sink = True
    scale = D**-0.5 if scaling is None else scaling

    if rt is not None and rt.batch is not None:  # attnkit's own batches are right-padded
        if decode:
            raise AttnkitError(f"attnkit's own batches run whole sequences, but this forward has {L} queries and "
                               f"{Lk} keys (a KV cache): run them without past_key_values")
        info, offsets = rt.batch, None
        lengths = info.lengths
        if lengths.shape[0] != B:
            raise AttnkitError(f"runtime batch has {lengths.shape[0]} samples but the model got {B}")
    else:
        info = None
        lengths, offsets = padding_of(attention_mask, B, Lk, query.device)
    if offsets is not None and decode:
        # left padding in generation: the keys' tokens to the front; the queries are already each sample's last
        # tokens, where every sample's tokens must end
        if not bool(((offsets + lengths) == Lk).all()):
            raise AttnkitError("a KV-cache step needs each sample's tokens to end at the last key (left padding, as "
                               "generate pads decoders); this attention mask has padding after a sample's tokens")
        key, value = (rolled(t, offsets, 2) for t in (key, value))
    elif offsets is not None:  # left padding: each sample's tokens to the front, computed there, put back after
        query, key, value = (rolled(t, offsets, 2) for t in (query, key, value))

    def own_frame(t: torch.Tensor, dims, row_dim: int) -> torch.Tensor:
        if offsets is None:
            return t
        if decode:  # the rows were not moved: only the keys go back
            return unshift(t, offsets, [d for d in dims if d != row_dim], row_dim, first_row=Lk - L)
        return unshift(t, offsets, dims, row_dim)

    tracker = rt.tracker if rt is not None and not decode else None  # a generation step is no training forward
    if tracker is not None and H > 0:
        track_classes = first_token_classes(B, L, query.device) if info is None else info.token_class
    # observers that take each head's max logit from the op's call (extraction's --max-logit), not q and k
    ml_observers = [o for o in rt.observers if getattr(o, "takes_max_logit", False)] if rt is not None else []
    want_ml = H > 0 and (bool(ml_observers) or (tracker is not None and tracker.want_max))
    if dropout and module.training:
        if decode:
            raise AttnkitError("attnkit does not run a KV-cache step with attention dropout on: call model.eval()")
        if tracker is not None and H > 0:  # the statistics of the weights before dropout (docs/training.md)
            with torch.no_grad():
                _, feats, *ml = attention(query, key, value, lengths, track_classes, None, scaling=scaling,
                                          num_windows=rt.num_windows, want_features=True, backend=rt.backend,
                                          want_max_logit=tracker.want_max, **dec)
            tracker.record(module.layer_idx, feats, ml[0] if ml else None, kept)
        if rt is not None and rt.active:
            raise AttnkitError("attnkit cannot measure or intervene while attention dropout is on: call model.eval()")
        if want_maps or dec or offsets is not None:
            # as eager attention does: the maps after dropout, and the output from them
            weights = torch.nn.functional.dropout(attention_weights(query, key, lengths, scale, **dec).to(query.dtype),
                                                  p=dropout, training=True)
            out = torch.matmul(weights, per_query_head(value, kv_index(H, Hkv, dec, query.device)))
            out = own_frame(out.transpose(1, 2).contiguous(), (1,), 1)
            if not want_maps:
                return out, None
            weights = own_frame(weights, (2, 3), 2)
            return out, weights if kept is None else to_unpruned(weights, kept)  # maps cover the unpruned heads
        # training: plain attention with dropout, exactly what sdpa computes
        bias = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None

    parts = key_scale = None
    want = False
    backend = "auto"
    num_windows = DEFAULT_NUM_WINDOWS
    sentence_id = info.sentence_id if info is not None else None
    if rt is not None:
        rt.calls += 1
        backend, num_windows = rt.backend, rt.num_windows
        want = rt.want_features and info is not None
        if info is None:
            check_sentences_shape(rt, B, L)
        if rt.intervention is not None:
            parts = rt.intervention.layer_plan(module.layer_idx, B, L, D, query.device, query.dtype)
            if decode and any(p.region is not None for p in parts):
                raise AttnkitError("region interventions need the sentence of every key, which a step of generation "
                                   "with a KV cache does not see (only its new tokens): generate with "
                                   "use_cache=False under a region intervention")
            if sentence_id is None and any(p.region is not None for p in parts):
                sentence_id = forward_sentence_ids(rt, B, L, lengths, query.device, offsets)
        if rt.observers and decode:
            raise AttnkitError("observers of q and k (e.g. JS distances) take whole sequences, not a step of "
                               "generation with a KV cache: run the forward without past_key_values")
        if rt.observers:  # observers see the unpruned heads (`observed`)
            obs_q, obs_k, obs_dec = observed(query, key, kept, dec)
            for obs in rt.observers:
                if getattr(obs, "takes_max_logit", False):
                    continue  # called after the op, with its max logit
                if not obs_dec:
                    obs(module.layer_idx, obs_q, obs_k, lengths, scaling)
                elif getattr(obs, "decoder_arguments", False):  # it computes a decoder's attention as the op does
                    obs(module.layer_idx, obs_q, obs_k, lengths, scaling, **obs_dec)
                else:
                    name = getattr(obs, "__qualname__", type(obs).__name__)
                    raise AttnkitError(
                        f"an observer of q and k ({name}) does not take a decoder's attention arguments (causal, KV "
                        "heads, sliding window, soft cap, sink): it would measure attention this model does not "
                        "compute, so this analysis does not support decoder models yet")
        if want and rt.weighting == "norm" and H > 0:
            if module.layer_idx not in rt.out_proj:
                raise AttnkitError("norm weighting needs each layer's output projection: measure inside "
                                   "attnkit.engine.forward.measuring(model, weighting='norm')")
            # each query head with its KV head's values and its own columns of the output projection
            key_scale = key_norms(per_query_head(value, kv_index(H, Hkv, dec, query.device)),
                                  output_matrix(rt.out_proj[module.layer_idx]))
    token_class = info.token_class if info is not None else None
    tracked = tracker is not None and H > 0
    if tracked and not want:  # the tracker's statistics come from the same call of the op
        want, token_class = True, track_classes
    parts = parts or [LayerPart(0, B)]
    if kept is not None:  # a pruned layer: the intervention's settings of the heads it kept
        # the probe forward of attnkit.models.instrument runs before DistilBERT's layers are numbered
        parts = [kept_part(p, kept, getattr(module, "layer_idx", None)) for p in parts]

    def by_length(rows: slice) -> list:
        """A left-padded KV-cache step, its keys moved to the front: sample b's queries are the last of its own
        n_b keys, so the samples of one length n go to the op together, with their first n keys and their last
        min(L, n) queries (the rows before are padding). [(positions in `rows`, sample indices, n, rows taken)]."""
        ns = lengths[rows].tolist()
        first = range(B)[rows].start
        groups = []
        for n in sorted(set(ns)):
            where = [i for i, m in enumerate(ns) if m == n]
            groups.append((where, torch.tensor([first + i for i in where], device=query.device), n, min(L, n)))
        return groups

    def call(p: LayerPart, rows: slice):
        if H == 0:  # a layer whose heads were all pruned: nothing to attend with (want_ml is False)
            n = query[rows].shape[0]
            return query.new_zeros(n, L, 0, D), query.new_zeros((n, 0, num_features(num_windows, "sink" in dec)),
                                                                dtype=torch.float32)
        if decode and offsets is not None:  # no features (attnkit's own batches are refused above)
            out = query.new_zeros(query[rows].shape[0], L, H, D)
            for where, idx, n, r in by_length(rows):
                out[where, L - r:] = attention(
                    query[idx, :, L - r:], key[idx, :, :n], value[idx, :, :n], lengths[idx], scaling=scaling,
                    num_windows=num_windows, mode=p.mode, region=p.region, renormalize=p.renormalize, gates=p.gates,
                    backend=backend, **dec)[0]
            return out, query.new_zeros((out.shape[0], H, 0), dtype=torch.float32)
        return attention(
            query[rows], key[rows], value[rows], lengths[rows],
            None if token_class is None else token_class[rows], None if sentence_id is None else sentence_id[rows],
            scaling=scaling, num_windows=num_windows, mode=p.mode, region=p.region,
            renormalize=p.renormalize, gates=p.gates, want_features=want,
            key_scale=None if key_scale is None else key_scale[rows], backend=backend, want_max_logit=want_ml, **dec,
        )

    # with want_ml, each head's max logit per sample (B×H) from the same call (attnkit.ops.attention)
    if len(parts) == 1:  # one call of the op for the whole batch
        out, feats, *ml = call(parts[0], slice(None))
        max_logit = ml[0] if want_ml else None
    else:  # stacked interventions: one call per block of samples
        results = [call(p, slice(p.start, p.stop)) for p in parts]
        out, feats = torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])
        max_logit = torch.cat([r[2] for r in results]) if want_ml else None
    out = own_frame(out, (1,), 1)  # rows of left padding: 0
    for p in parts:
        out = replace_head_outputs(out, p.outputs, slice(p.start, p.stop))
    if want:
        # every feature is a mass or an entropy, never negative: a backend's rounding (win_15 = -1.96e-11) is
        # clamped here, where the features of every backend and engine enter the runtime (docs/features.md §3)
        feats = feats.clamp(min=0.0)
    if tracked:
        tracker.record(module.layer_idx, feats, max_logit, kept)
    for obs in ml_observers:  # the unpruned heads; a removed head's max logit NaN
        obs.add_max_logit(module.layer_idx, max_logit if kept is None else to_unpruned(max_logit, kept, float("nan")))
    if want and rt.want_features and info is not None:
        # a pruned layer's removed heads have no attention, hence no features: NaN (docs/pruning.md)
        rt.features[module.layer_idx] = feats if kept is None else to_unpruned(feats, kept, float("nan"))
    if rt is not None and rt.head_caches:  # caches hold the unpruned heads (removed ones output 0)
        heads_out = out if kept is None else to_unpruned(out.transpose(1, 2), kept).transpose(1, 2)
        for cache in rt.head_caches:
            cache.record(module.layer_idx, heads_out)
    if not want_maps:
        if rt is not None and rt.stop_when_measured and isinstance(rt.features, LayerFeatures) \
                and rt.features.complete():
            raise FeaturesComplete  # caught by attnkit.engine.forward.forward_features
        return out, None
    # the weights this forward used, interventions included (their definition: attnkit.reference); a pruned
    # layer's maps cover the unpruned heads, a removed head's map all zeros (as its features)
    def part_weights(p: LayerPart) -> torch.Tensor:
        rows = slice(p.start, p.stop)
        if not (decode and offsets is not None):
            return attention_weights(query[rows], key[rows], lengths[rows], scale,
                                     None if sentence_id is None else sentence_id[rows], p.mode, p.region,
                                     p.renormalize, **dec)
        w = query.new_zeros(query[rows].shape[0], H, L, Lk, dtype=torch.float32)
        for where, idx, n, r in by_length(rows):  # as `call` computes them
            w[where, :, L - r:, :n] = attention_weights(query[idx, :, L - r:], key[idx, :, :n], lengths[idx], scale,
                                                        None, p.mode, p.region, p.renormalize, **dec)
        return w

    weights = query.new_zeros(B, 0, L, Lk, dtype=torch.float32) if H == 0 else torch.cat([
        part_weights(p) for p in parts])
    weights = own_frame(weights, (2, 3), 2)
    if kept is not None:
        weights = to_unpruned(weights, kept)
    return out, weights.to(query.dtype)


def padding_mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """transformers' mask function for attnkit: the 2-D padding mask (None when the batch has no
    padding). While compiling or capturing a CUDA graph, the mask is handed over even without padding:
    deciding "no padding" needs its values on the host (a graph break, or a sync that a capture
    forbids), and lengths_from_mask handles a full mask just as well."""
    if attention_mask is not None and (
        torch.compiler.is_compiling() or (attention_mask.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return attention_mask[:, -kv_length:]
    return flash_attention_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make "attnkit" a valid `attn_implementation` (idempotent): `import attnkit` calls it, and so does
    `attnkit.models.instrument` before it switches a model to it."""
    AttentionInterface.register(NAME, attnkit_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


register()  # importing this module makes attn_implementation="attnkit" valid (attnkit/__init__.py imports it
#             as soon as transformers is imported)
