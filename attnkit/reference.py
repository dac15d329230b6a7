"""The executable specification: pure-PyTorch attention with interventions and per-head features.

Every backend (the C++ and CUDA ops) is tested against `reference_attention`. It materialises the
B×H×L×L weights, so it is for correctness and small inputs, not for speed. It is differentiable
(autograd flows to q, k, v and gates), which the fused op's backward relies on.

Semantics (docs/features.md, docs/interventions.md):
  * Padding is per sample: keys `t >= lengths[b]` get weight 0. Padded query rows still attend to the
    valid keys (as eager attention does) but contribute no features.
  * Weights = softmax(q kᵀ · scaling) → mode (keep / zero / uniform 1/n) → region (zero the intra- or
    inter-sentence keys) → optional renormalisation of what is left (a row with nothing left stays 0).
  * Output = weights · v, times the head's gate; returned as B×L×H×D like transformers expects.
  * Features describe the final weights and are means over the n valid query rows of each sample,
    except `cls_entropy`, the mean entropy of the rows whose token class is CLS (0 if there is none).
  * Values at padding positions (q, k, v rows t >= n) never reach valid rows or features, whatever
    they hold (even NaN). A head in mode zero outputs exactly 0 (its features are 0).

  * Decoder arguments (docs/features.md, "Decoder models"): k and v may have Hkv heads and `kv_head` (H ints in
    [0, Hkv)) names the KV head of each query head (None: Hkv == H, or even groups h // (H // Hkv) when Hkv
    divides H); K/V are never repeated in memory by the fused ops. The keys row s *sees* are t < n, and with
    `causal` t <= s, and with `sliding_window` W also s − t < W (transformers' `kv_idx > q_idx − W`; without
    `causal` the window limits only the keys before s), and with `symmetric_window` also t − s < W: |s − t| < W,
    the bidirectional window of ModernBERT's local layers (transformers' create_bidirectional_sliding_window_mask,
    |q_idx − kv_idx| ≤ config.sliding_window, the module passing W = config.sliding_window + 1). Keys a row does
    not see are treated like padding: weight 0, and their scores (even NaN) are never read. `softcap` c: scores
    become c·tanh(q·k·scaling / c) (Gemma 2) before the softmax. `sink` (H floats, gpt-oss's s_aux): a logit that
    joins each row's softmax denominator, takes mass and adds no value; the weights of a row's keys then sum to
    1 − its sink mass.
  * Interventions on decoder rows: mode uniform puts 1/m on each of the m keys the row sees (sink mass 0); mode
    zero makes the sink mass 0 too; regions never drop the sink (it is in no sentence), and `renormalize`
    rescales the kept keys together with the sink mass to sum 1. A padded row that sees no key (only possible
    with a sliding window) has weight 0 everywhere (output 0), not NaN.
  * With `sink` and features wanted, one more feature comes last: `sink`, the row's sink mass averaged over
    the n rows like the others (the 21 buckets plus `sink` sum to 1). Norm weighting gives the sink weight 0
    (it adds no value vector, so its ‖f‖ is 0).

  * Images (docs/features.md, "Image heads"): `grid` (B×L×2 integers) gives each token's (row, column) on the
    image's patch grid, (−1, −1) for a token that is no patch ([CLS], a distillation token, registers). With
    features wanted, six more features come last (after `sink`, IMAGE_FEATURES): `mean_attention_distance`, for
    each patch row s Σ_t w[s, t]·‖grid(s) − grid(t)‖ over the patch keys t (mass on keys that are no patch adds
    nothing: it is not renormalised away), then the ring masses `ring_0`, `ring_1`, `ring_2`, `ring_4`, `ring_8`,
    for each patch row s Σ_t w[s, t] over the patch keys t with R <= ‖grid(s) − grid(t)‖ < the next bound of
    RING_BOUNDS (0, 1, 2, 4, 8, ∞), each averaged over the sample's valid patch rows (0 for a sample with none).
    Only this reference measures them: calls with a grid and features run on it on every device. Without features
    `grid` is not read. A grid is one sequence's tokens on one image: with cross-attention (`key_lengths`, two
    sequences) it is refused by name.

  * Alignment (docs/features.md, "Alignment features"): with `alignment` and features wanted, two more features come
    last (after the image features, ALIGNMENT_FEATURES): each valid row i has an aligned key position p_i, its own
    position s for self-attention (encoder, causal decoder, a KV-cache step alike) and i·(nk − 1)/(nq − 1) for
    cross-attention (nq valid query rows, nk valid keys; 0 when nq = 1); `align_offset` is Σ_t w[i, t]·|t − p_i| (in
    tokens) and `align_near` Σ_t w[i, t] over the keys with |t − ⌊p_i + 1/2⌋| <= 1, each averaged over the valid
    rows. They describe the final weights as every feature does (interventions, norm weighting); a sink's mass is on
    no key and adds to neither. Without features `alignment` is not read.

  * Norm weighting (docs/features.md, "Norm-weighted features"): with a key scale g (B×H×L, ≥ 0) the
    features describe w'[s, t] = w[s, t]·g[t] / Σ_u w[s, u]·g[u] instead of the final weights w (a row
    whose Σ is 0 stays 0); the output is unchanged.

  * Fewer queries than keys (a step of generation with a KV cache; docs/decoders.md, "Generation"): q may have
    Lq < L rows. They are the LAST Lq key positions: query row i is position s = L − Lq + i (`query_positions`),
    and everything above holds with that s — causal t <= s, the window s − t < W, the self bucket t == s, the
    distance |s − t|, prev/next w[s, s ∓ 1], the row's own sentence id and token class those of position s. lengths
    (n), token_class, sentence_id and key_scale are over the L keys. A row is valid when s < n; the features are
    the mean of the valid rows' features (each defined as in a full forward, windows by the same n), which is the
    mean over the n rows when Lq = L; a sample with no valid row gets 0. With Lq = L nothing changes.

  * Cross-attention (`key_lengths` given; docs/seq2seq.md): queries from one sequence (a decoder's target), keys
    and values from another (the encoder's source), Lq and Lk any sizes. `lengths` (n) are then the query lengths
    (in [1, Lq]) and `key_lengths` (nk) the key lengths (in [1, Lk]); row i sees the keys t < nk (no causal mask,
    no window); rows i >= n are padding (they attend as valid rows do, eager's way, and add no features).
    `token_class` is then B×Lq, the queries' classes (only the CLS rows of `cls_entropy` read it), and `key_class`
    B×Lk the keys' (the buckets cls/sep/comma/period). The row's own position is s = i, compared with the key
    positions t of the other sequence: self is the key t == i (class OTHER), prev/next the keys i ∓ 1, distance
    windows w = min(N − 1, floor(|i − t| · N / nk)): the features describe how close a head stays to the diagonal.
    Sentence ids and regions need the row's sentence among the keys: refused (intra is the row's mass, inter 0).
    key_scale is B×H×Lk.
  * `bias` (T5's `position_bias`; self- or cross-attention): an additive float tensor (1 or B)×H×Lq×Lk added to
    q·k·scaling before the soft cap and the softmax (−inf hides a key; the numerics policy holds with it). The
    max logit stays q·k·scaling, without it.

Arguments (checked by every backend, errors name the argument): q B×H×Lq×D with D >= 1 (Lq <= L); k and v of one
shape B×Hkv×L×D (Hkv = H, or as `kv_head` says); kv_head H integers in [0, Hkv); sliding_window an integer >= 1;
symmetric_window a bool, true only with a sliding_window; softcap a finite number > 0; sink H floats; lengths B
integers in [1, L]; token_class B×L codes OTHER..PERIOD (0..4) at valid positions when features are wanted;
sentence_id B×L integers, compared as integers (any int32 value); mode H codes KEEP/ZERO/UNIFORM (0..2); region
H codes ALL/NO_INTRA/NO_INTER (0..2); gates H floats; key_scale B×H×L floats, finite and >= 0 at valid keys
(checked here; the compiled kernels trust it); grid B×L×2 integers, (row, col) >= 0 or (−1, −1) at valid positions
when features are wanted; num_windows from 1 to 1024 (MAX_NUM_WINDOWS); scaling a finite number (inf or NaN is
refused). Cross-attention: key_lengths B integers in [1, Lk] (then lengths in [1, Lq], token_class B×Lq), key_class
B×Lk codes 0..4 at valid keys, no sentence_id, region, causal, sliding_window, symmetric_window (a window over another
sequence is undefined) or grid; bias (1 or B)×H×Lq×Lk floats; alignment a bool.

Numerics policy (NaN propagates, as in torch.softmax and scaled_dot_product_attention): a query row
whose softmax is undefined — a NaN score among the keys it sees, a +inf score, or every score −inf (with
a sink: a NaN or +inf sink, or every score and the sink −inf) — has NaN weights on every key it sees (and a
NaN sink mass) (whatever region intervention follows; modes zero and uniform do
not use the scores and stay finite). Its output row is NaN, and all features of its (sample, head)
are NaN when the row is a valid one. A NaN or inf in v at a valid key reaches the output the way a
matrix product carries it (0 · NaN = NaN), but not the features, which describe weights only (with causal
or a window, whether it reaches the rows that do not see that key is left open: the fused kernels skip
the tiles those rows do not see).
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from .errors import MAX_NUM_WINDOWS, AttnkitError
from .features import (
    CLS,
    COMMA,
    DEFAULT_NUM_WINDOWS,
    KEEP,
    NO_INTER,
    NO_INTRA,
    OTHER,
    PERIOD,
    RING_BOUNDS,
    SEP,
    UNIFORM,
    ZERO,
    num_features,
)


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """The op's arguments after q, k, v and lengths, defined once (as FlashAttention's Flash_fwd_params): the fields
    are in the order of the schema of `attnkit::fused_attention` (csrc/ops.cpp), so `AttentionParams(*args)` reads
    the op's positional arguments after lengths and `op_args()` gives them back. `attnkit.ops.attention`,
    `reference_attention`, the fake kernels, the autograd functions and the Triton wrapper all take their arguments
    through it; the contract (module docstring, "Arguments") is checked by `check_layout` and `check`.

    token_class, sentence_id: B×L (None: all OTHER / one sentence); scaling (None: D^-1/2); num_windows; mode,
    region: H codes; renormalize; gates: H floats; want_features; key_scale: B×H×L (norm weighting); the decoder
    arguments kv_head, causal, sliding_window, softcap, sink; cross-attention's key_lengths (B) and key_class (B×Lk),
    and an additive bias ((1 or B)×H×Lq×Lk); symmetric_window; grid: B×L×2, an image's patch grid; alignment: the
    alignment features (module docstring). `fused_attention_lse` takes the fields before key_lengths, then
    symmetric_window, want_max_logit, grid and alignment (cross-attention and a bias never run on it)."""

    token_class: torch.Tensor | None = None
    sentence_id: torch.Tensor | None = None
    scaling: float | None = None
    num_windows: int = DEFAULT_NUM_WINDOWS
    mode: torch.Tensor | None = None
    region: torch.Tensor | None = None
    renormalize: bool = False
    gates: torch.Tensor | None = None
    want_features: bool = False
    key_scale: torch.Tensor | None = None
    kv_head: torch.Tensor | None = None
    causal: bool = False
    sliding_window: int | None = None
    softcap: float | None = None
    sink: torch.Tensor | None = None
    key_lengths: torch.Tensor | None = None
    key_class: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    symmetric_window: bool = False
    grid: torch.Tensor | None = None
    alignment: bool = False

    @property
    def cross(self) -> bool:
        """Cross-attention: queries and keys from two sequences (module docstring)."""
        return self.key_lengths is not None

    @classmethod
    def position(cls, name: str) -> int:
        """The position of argument `name` in the op's schema (q, k, v and lengths come first)."""
        return 4 + [f.name for f in dataclasses.fields(cls)].index(name)

    def op_args(self) -> tuple:
        """The arguments after lengths, in the schema's order and types, for a call of the compiled op."""
        return (self.token_class, self.sentence_id, float(self.scaling), int(self.num_windows), self.mode,
                self.region, bool(self.renormalize), self.gates, bool(self.want_features), self.key_scale,
                self.kv_head, bool(self.causal), self.sliding_window, self.softcap, self.sink, self.key_lengths,
                self.key_class, self.bias, bool(self.symmetric_window), self.grid, bool(self.alignment))

    def tensors(self) -> tuple:
        """The tensor arguments (None where not given), in field order: what autograd saves."""
        return tuple(getattr(self, name) for name in TENSOR_ARGUMENTS)

    @staticmethod
    def of(token_class: torch.Tensor | None = None, sentence_id: torch.Tensor | None = None,
           **params) -> AttentionParams:
        """`AttentionParams(token_class, sentence_id, **params)` without the frozen dataclass's __init__, which sets
        each field through object.__setattr__: the op's wrapper builds one per attention call (`attnkit.ops`).
        Unknown names are refused with a TypeError, as __init__ refuses them."""
        params["token_class"], params["sentence_id"] = token_class, sentence_id
        return _made(_DEFAULTS, params)

    def replaced(self, **changes) -> AttentionParams:
        """`dataclasses.replace(self, **changes)` without running __init__ over every field again: the op's wrapper
        converts the arguments of every attention call (`attnkit.ops`), where that was a tenth of a short call's
        time. Unknown names are refused as replace refuses them."""
        return _made(self.__dict__, changes)

    def with_tensors(self, tensors) -> AttentionParams:
        """These arguments with the tensor ones replaced by `tensors` (`tensors()`'s order)."""
        return dataclasses.replace(self, **dict(zip(TENSOR_ARGUMENTS, tensors)))

    def decoder(self) -> dict:
        """The decoder arguments as keywords (`attention_weights`, `visible_keys`' callers, the backward)."""
        return {name: getattr(self, name) for name in DECODER_ARGUMENTS}

    def decoder_used(self, heads: int, kv_heads: int) -> list[str]:
        """The decoder arguments a call uses (grouped K/V counts as kv_head): what a build without them refuses."""
        used = {"kv_head": self.kv_head is not None or kv_heads != heads, "causal": bool(self.causal),
                "sliding_window": self.sliding_window is not None, "softcap": self.softcap is not None,
                "sink": self.sink is not None, "symmetric_window": bool(self.symmetric_window)}
        return [name for name, given in used.items() if given]

    def _check_decoder(self, H: int, Hkv: int) -> None:
        """`check_layout`'s part for the decoder arguments (kv_head, sliding_window, softcap, sink)."""
        kv_head, sliding_window, softcap, sink = self.kv_head, self.sliding_window, self.softcap, self.sink
        if kv_head is not None:
            _int_tensor(kv_head, "kv_head", (H,))
        elif Hkv != H and (Hkv > H or H % Hkv):
            raise AttnkitError(f"k and v have {Hkv} heads and q {H}: give kv_head (the KV head of each query head) "
                               f"unless {Hkv} divides {H}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise AttnkitError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
        if not isinstance(self.alignment, bool):
            raise AttnkitError(f"alignment must be a bool, got {self.alignment!r}")
        if not isinstance(self.symmetric_window, bool):
            raise AttnkitError(f"symmetric_window must be a bool, got {self.symmetric_window!r}")
        if self.symmetric_window and sliding_window is None:
            raise AttnkitError("symmetric_window needs a sliding_window (it makes the window limit the keys after "
                               "each row too)")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or not math.isfinite(softcap) or softcap <= 0):
            raise AttnkitError(f"softcap must be a finite number > 0, got {softcap!r}")
        if sink is not None:
            if not isinstance(sink, torch.Tensor) or not sink.is_floating_point():
                raise AttnkitError(f"sink must be a floating-point tensor, got {getattr(sink, 'dtype', type(sink))}")
            if tuple(sink.shape) != (H,):
                raise AttnkitError(f"sink must have shape [{H}], got {list(sink.shape)}")

    def _check_cross(self, B: int, H: int, Lq: int, Lk: int) -> None:
        """`check_layout`'s part for cross-attention (key_lengths, key_class) and the bias."""
        if self.cross:
            _int_tensor(self.key_lengths, "key_lengths", (B,))
            if self.key_class is not None:
                _int_tensor(self.key_class, "key_class", (B, Lk))
            if self.symmetric_window:
                raise AttnkitError("cross-attention (key_lengths given) takes no symmetric_window: a window over "
                                   "another sequence's keys is undefined")
            refused = [name for name, given in (("sentence_id", self.sentence_id is not None),
                                                ("region", self.region is not None), ("causal", bool(self.causal)),
                                                ("sliding_window", self.sliding_window is not None)) if given]
            if refused:
                raise AttnkitError(f"cross-attention (key_lengths given) takes no {refused[0]}: its rows see every "
                                   "key of the other sequence, and sentences (regions) are not defined across two "
                                   "sequences")
            if self.grid is not None:
                raise AttnkitError("cross-attention (key_lengths given) takes no grid: a grid places the tokens of "
                                   "one sequence on an image's patches (docs/features.md, \"Image heads\")")
        elif self.key_class is not None:
            raise AttnkitError("key_class is the keys' token classes of cross-attention: give key_lengths too")
        bias = self.bias
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise AttnkitError(f"bias must be a floating-point tensor, got {getattr(bias, 'dtype', type(bias))}")
            if bias.dim() != 4 or bias.shape[0] not in (1, B) or tuple(bias.shape[1:]) != (H, Lq, Lk):
                raise AttnkitError(f"bias must have shape [{B} or 1, {H}, {Lq}, {Lk}], got {list(bias.shape)}")

    def check_layout(self, q, k, v, lengths) -> None:
        """The part of the contract that reads no tensor values (shapes, dtypes, head dim, scaling, num_windows):
        cheap, and run by every backend before it converts anything (so lengths of a float dtype are refused by
        the fused op as by the reference, not rounded)."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise AttnkitError(f"q must be 4-D (B, H, L, D), got shape {tuple(getattr(q, 'shape', ()))}")
        B, H, Lq, D = q.shape
        if (not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4 or k.shape != v.shape
                or (k.shape[0], k.shape[3]) != (B, D) or (k.shape[2] < Lq and not self.cross) or k.shape[1] < 1
                or k.shape[2] < 1):
            raise AttnkitError(f"k and v must have q's shape {tuple(q.shape)} (or B×Hkv×L×D with Hkv KV heads and "
                               f"L >= q's {Lq} rows: a KV-cache step; any L with key_lengths: cross-attention), got "
                               f"k {tuple(getattr(k, 'shape', ()))} and v {tuple(getattr(v, 'shape', ()))}")
        L = k.shape[2]  # the keys: lengths, token classes, sentence ids and key scales are over them
        self._check_decoder(H, k.shape[1])
        self._check_cross(B, H, Lq, L)
        if D < 1:
            raise AttnkitError(f"head dim (q.size(3)) must be >= 1, got {D}")
        if self.scaling is not None and not math.isfinite(float(self.scaling)):
            raise AttnkitError(f"scaling must be a finite number, got {self.scaling}")
        num_windows = self.num_windows
        if isinstance(num_windows, bool) or not isinstance(num_windows, int) or num_windows < 1:
            raise AttnkitError(f"num_windows must be an integer >= 1, got {num_windows!r}")
        if num_windows > MAX_NUM_WINDOWS:  # the limit of every backend (attnkit.errors.INT_RANGES)
            raise AttnkitError(f"num_windows must be at most {MAX_NUM_WINDOWS}, got {num_windows!r}")
        _int_tensor(lengths, "lengths", (B,))
        for t, name in ((self.mode, "mode"), (self.region, "region")):
            if t is not None:
                _int_tensor(t, name, (H,))
        if self.sentence_id is not None:
            _int_tensor(self.sentence_id, "sentence_id", (B, L))
        if self.token_class is not None:
            _int_tensor(self.token_class, "token_class", (B, Lq if self.cross else L))
        if self.grid is not None:
            _int_tensor(self.grid, "grid", (B, L, 2))
        if self.gates is not None and tuple(self.gates.shape) != (H,):
            raise AttnkitError(f"gates must have shape [{H}], got {list(self.gates.shape)}")
        key_scale = self.key_scale
        if key_scale is not None:
            if not key_scale.is_floating_point():
                raise AttnkitError(f"key_scale must be a floating-point tensor, got {key_scale.dtype}")
            if tuple(key_scale.shape) != (B, H, L):
                raise AttnkitError(f"key_scale must have shape [{B}, {H}, {L}], got {list(key_scale.shape)}")

    def check(self, q, k, v, lengths) -> None:
        """The argument contract every backend enforces (module docstring); AttnkitError names the argument."""
        self.check_layout(q, k, v, lengths)
        L = k.shape[2]
        kv_head, token_class, key_scale = self.kv_head, self.token_class, self.key_scale
        if kv_head is not None:
            Hkv = k.shape[1]
            bad_kv = (kv_head < 0) | (kv_head >= Hkv)
            _require(~bad_kv.any(), lambda: f"kv_head must lie in [0, Hkv) = [0, {Hkv}), got "
                                            f"{kv_head[bad_kv][0].item()} at head {bad_kv.nonzero()[0].item()}")
        Lq, cross = q.shape[2], self.cross
        _check_lengths(lengths, "lengths", Lq if cross else L, "Lq" if cross else "L")
        if cross:
            _check_lengths(self.key_lengths, "key_lengths", L, "Lk")
        key_lengths = self.key_lengths if cross else lengths
        for t, name, names in ((self.mode, "mode", "0 (keep), 1 (zero) or 2 (uniform)"),
                               (self.region, "region", "0 (all), 1 (no_intra) or 2 (no_inter)")):
            if t is None:
                continue
            bad_code = (t < 0) | (t > 2)
            _require(~bad_code.any(), lambda: f"{name} codes must be {names}, got {t[bad_code][0].item()} at head "  # noqa: B023
                                              f"{bad_code.nonzero()[0].item()}")  # noqa: B023 (called at once)
        if self.want_features:
            for classes, name, n in ((token_class, "token_class", lengths), (self.key_class, "key_class", key_lengths)):
                if classes is None:
                    continue
                valid = _key_mask(n.to(classes.device).long(), classes.shape[1])
                bad_cls = valid & ((classes < OTHER) | (classes > PERIOD))
                _require(~bad_cls.any(), lambda: f"{name} codes must be 0..4 at valid positions, got "  # noqa: B023
                                                 f"{classes[bad_cls][0].item()} at {_first_bad(bad_cls)}")  # noqa: B023
        if self.grid is not None and self.want_features:
            grid = self.grid
            valid = _key_mask(lengths.to(grid.device).long(), L)
            r, c = grid[..., 0], grid[..., 1]
            bad_pos = valid & ~(((r == -1) & (c == -1)) | ((r >= 0) & (c >= 0)))
            _require(~bad_pos.any(), lambda: f"grid positions must be (row, col) >= 0 for a patch or (-1, -1) for "
                                             f"another token, got {grid[bad_pos][0].tolist()} at "
                                             f"{_first_bad(bad_pos)}")
        if key_scale is not None and self.want_features:
            valid = _key_mask(key_lengths.to(key_scale.device).long(), L)[:, None, :]
            bad = valid & ~(torch.isfinite(key_scale) & (key_scale >= 0))
            _require(~bad.any(), lambda: f"key_scale must be finite and >= 0 at valid keys, got "
                                         f"{key_scale[bad][0].item()} at {_first_bad(bad)}")


def _check_lengths(lengths: torch.Tensor, name: str, top: int, top_name: str) -> None:
    bad = (lengths < 1) | (lengths > top)
    _require(~bad.any(), lambda: f"{name} must lie in [1, {top_name}] = [1, {top}], got {name}{_first_bad(bad)} = "
                                 f"{lengths[bad][0].item()}")


TENSOR_ARGUMENTS = ("token_class", "sentence_id", "mode", "region", "gates", "key_scale", "kv_head", "sink",
                    "key_lengths", "key_class", "bias", "grid")
DECODER_ARGUMENTS = ("kv_head", "causal", "sliding_window", "softcap", "sink", "symmetric_window")
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(AttentionParams))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttentionParams)}


def _made(fields: dict, changes: dict) -> AttentionParams:
    """AttentionParams with `fields`, then `changes`, without __init__ (`AttentionParams.of` and `replaced`); an
    unknown name in `changes` is refused as the dataclass refuses it."""
    unknown = changes.keys() - _FIELD_NAMES
    if unknown:
        raise TypeError(f"AttentionParams has no field {sorted(unknown)[0]!r}")
    new = object.__new__(AttentionParams)
    new.__dict__.update(fields)
    new.__dict__.update(changes)
    return new


# what `attention_weights` takes besides the interventions: the decoder arguments, cross-attention's key lengths and
# the additive bias
WEIGHT_ARGUMENTS = (*DECODER_ARGUMENTS, "key_lengths", "bias")


def takes_params(fn):
    """`fn`, whose `**params` are AttentionParams' fields, with a signature that lists them as keyword-only
    arguments with their defaults (for help() and editors; the fields stay written once)."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named = {p.name for p in own}
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
              for f in dataclasses.fields(AttentionParams) if f.name not in named]
    ordered = sorted(own + fields, key=lambda p: p.kind)  # keyword-only arguments after the positional ones
    fn.__signature__ = sig.replace(parameters=ordered)
    return fn


def _key_mask(lengths: torch.Tensor, L: int) -> torch.Tensor:
    """B×L bool, True on valid (non-padding) positions."""
    return torch.arange(L, device=lengths.device)[None, :] < lengths[:, None]


def query_positions(Lq: int, Lk: int, device=None) -> torch.Tensor:
    """The key positions of the Lq query rows (int64 Lq): the last Lq of the Lk keys, Lk − Lq … Lk − 1 (a KV-cache
    step; 0 … L − 1 when Lq = Lk)."""
    return torch.arange(Lk - Lq, Lk, device=device)


def visible_keys(lengths: torch.Tensor, L: int, causal: bool = False,
                 sliding_window: int | None = None, Lq: int | None = None,
                 symmetric_window: bool = False) -> torch.Tensor:
    """B×1×Lq×L bool (Lq defaults to L): True where query row i, at key position s = L − Lq + i
    (`query_positions`), sees key t (t < n; with `causal` t <= s; with a sliding window W also s − t < W, and with
    `symmetric_window` t − s < W)."""
    vis = _key_mask(lengths, L)[:, None, None, :]
    pos = torch.arange(L, device=lengths.device)
    offset = query_positions(L if Lq is None else Lq, L, lengths.device)[:, None] - pos[None, :]  # s − t
    if causal:
        vis = vis & (offset >= 0)
    if sliding_window is not None:
        vis = vis & (offset < sliding_window)
        if symmetric_window:
            vis = vis & (offset > -sliding_window)
    return vis


def resolve_kv_head(H: int, Hkv: int, kv_head: torch.Tensor | None, device=None) -> torch.Tensor:
    """The KV head of each of the H query heads (int64 H): `kv_head` itself, or by default the identity
    (Hkv == H) or even groups h // (H // Hkv). AttentionParams.check_layout has refused any other Hkv without
    kv_head."""
    if kv_head is not None:
        return kv_head.to(device=device, dtype=torch.long)
    return torch.arange(H, device=device) // (H // Hkv)


def intervene_weights(
    weights: torch.Tensor,
    lengths: torch.Tensor,
    sentence_id: torch.Tensor | None,
    mode: torch.Tensor | None,
    region: torch.Tensor | None,
    renormalize: bool,
    *,
    visible: torch.Tensor | None = None,
    sink_weights: torch.Tensor | None = None,
):
    """Apply per-head mode and region to B×H×Lq×L softmax weights (keys a row does not see already 0; query row i
    is key position L − Lq + i, `query_positions`).

    `visible` (B×1×Lq×L bool, `visible_keys`; None: the valid keys) are the keys each row sees: mode uniform
    spreads the row over them. `sink_weights` (B×H×L, the sink's mass per row, or None): zeroed with mode zero
    and uniform, kept by regions, rescaled with the kept keys by `renormalize`. Returns the weights, or
    (weights, sink weights) when `sink_weights` is given."""
    B, H, Lq, L = weights.shape
    if visible is None:
        visible = _key_mask(lengths, L)[:, None, None, :].expand(B, 1, Lq, L)
    if mode is not None:
        mode = mode.to(weights.device).view(1, H, 1, 1)
        seen = visible.to(weights.dtype)
        uniform = seen / seen.sum(-1, keepdim=True).clamp(min=1)
        weights = torch.where(mode == ZERO, torch.zeros_like(weights), weights)
        weights = torch.where(mode == UNIFORM, uniform.expand_as(weights), weights)
        if sink_weights is not None:
            sink_weights = torch.where(mode[..., 0] == KEEP, sink_weights, 0.0)
    if region is not None:
        region = region.to(weights.device).view(1, H, 1, 1)
        if sentence_id is None:
            same = torch.ones(B, 1, Lq, L, dtype=torch.bool, device=weights.device)
        else:
            same = (sentence_id[:, L - Lq:, None] == sentence_id[:, None, :])[:, None]  # B×1×Lq×L
        drop = ((region == NO_INTRA) & same) | ((region == NO_INTER) & ~same)
        weights = weights.masked_fill(drop, 0.0)
    if renormalize:
        total = weights.sum(-1, keepdim=True)
        if sink_weights is not None:
            total = total + sink_weights[..., None]
        scale = torch.where(total > 0, 1 / total.clamp(min=torch.finfo(weights.dtype).tiny), 1.0)
        weights = weights * scale
        if sink_weights is not None:
            sink_weights = sink_weights * scale[..., 0]
    return weights if sink_weights is None else (weights, sink_weights)


def attention_scores(q: torch.Tensor, k: torch.Tensor, scaling: float, *, kv_head: torch.Tensor | None = None,
                     softcap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """B×H×Lq×L fp32 scores q·kᵀ·scaling of each query head against its KV head's keys, plus `bias` where given,
    soft-capped to softcap·tanh(score / softcap) when `softcap` is given (before any mask)."""
    H, Hkv = q.shape[1], k.shape[1]
    kf = k.float()
    if Hkv != H or kv_head is not None:
        kf = kf.index_select(1, resolve_kv_head(H, Hkv, kv_head, q.device))
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scaling
    if bias is not None:
        scores = scores + bias.to(scores.device, torch.float32)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return scores


def attention_weights(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scaling: float,
                      sentence_id: torch.Tensor | None = None, mode: torch.Tensor | None = None,
                      region: torch.Tensor | None = None, renormalize: bool = False, *, return_sink: bool = False,
                      **decoder):
    """B×H×Lq×L fp32 weights after softmax and interventions (keys a row does not see 0; NaN policy above; q has
    Lq ≤ L rows, the last Lq key positions: module docstring, "Fewer queries than keys"). `decoder`: the decoder
    arguments of AttentionParams (kv_head, causal, sliding_window, softcap, sink), and cross-attention's
    key_lengths and the bias (`WEIGHT_ARGUMENTS`; with key_lengths, `lengths` are the query lengths).
    With a sink, a row's weights sum to 1 − its sink mass (the map transformers' eager gpt-oss returns);
    `return_sink` returns (weights, B×H×L sink mass per row, or None without `sink`)."""
    unknown = set(decoder) - set(WEIGHT_ARGUMENTS)
    if unknown:
        raise TypeError(f"attention_weights() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    p = AttentionParams(sentence_id=sentence_id, scaling=scaling, mode=mode, region=region, renormalize=renormalize,
                        **decoder)
    return params_weights(q, k, lengths, p, return_sink=return_sink)


def params_weights(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, p: AttentionParams, *,
                   return_sink: bool = False):
    """`attention_weights` of the arguments `p` (its scaling given)."""
    B, H, Lq, _ = q.shape
    L = k.shape[2]
    lengths = (p.key_lengths if p.cross else lengths).to(q.device).long()  # from here on: over the keys
    scores = attention_scores(q, k, p.scaling, kv_head=p.kv_head, softcap=p.softcap, bias=p.bias)
    visible = visible_keys(lengths, L, p.causal, p.sliding_window, Lq, p.symmetric_window)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink, mode = p.sink, p.mode
    sink_w = None
    if sink is None:
        weights = torch.softmax(scores, dim=-1)
        sees_any = visible.any(-1, keepdim=True)  # B×1×L×1; False only for padded rows outside a window
        weights = torch.where(sees_any, weights, 0.0)
    else:
        logit = sink.to(q.device, torch.float32).view(1, H, 1, 1).expand(B, H, Lq, 1)
        both = torch.softmax(torch.cat([scores, logit], dim=-1), dim=-1)
        weights, sink_w = both[..., :L], both[..., L]
    undefined = weights.isnan().any(-1, keepdim=True)  # B×H×L×1: NaN / +inf score, or all −inf
    if sink_w is None:
        weights = intervene_weights(weights, lengths, p.sentence_id, mode, p.region, p.renormalize, visible=visible)
    else:
        weights, sink_w = intervene_weights(weights, lengths, p.sentence_id, mode, p.region, p.renormalize,
                                            visible=visible, sink_weights=sink_w)
    uses_scores = undefined if mode is None else undefined & (mode.to(q.device).view(1, H, 1, 1) == KEEP)
    nan_row = torch.where(visible, float("nan"), 0.0)
    weights = torch.where(uses_scores, nan_row, weights)
    if sink_w is not None:
        sink_w = torch.where(uses_scores[..., 0], float("nan"), sink_w)
    return (weights, sink_w) if return_sink else weights


def max_logits(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scaling: float, *,
               kv_head: torch.Tensor | None = None, causal: bool = False,
               sliding_window: int | None = None, key_lengths: torch.Tensor | None = None,
               symmetric_window: bool = False) -> torch.Tensor:
    """B×H fp32: each head's max logit per sample (docs/features.md, "Max logit"): the largest q_s·k_t·scaling over
    the valid query rows s < n and the keys t each sees, before any soft-cap; NaN scores propagate. q has Lq ≤ L
    rows, at their true positions s = L − Lq + i (`query_positions`); a sample with no valid row (a KV-cache step
    past its length) has −inf, the maximum of nothing, which leaves any maximum taken over samples unchanged.
    Cross-attention (`key_lengths`): the rows i < lengths, the keys t < key_lengths."""
    Lq, L = q.shape[2], k.shape[2]
    lengths = lengths.to(q.device).long()
    scores = attention_scores(q, k, scaling, kv_head=kv_head)
    cross = key_lengths is not None
    valid_rows = query_positions(Lq, Lq if cross else L, q.device)[None, :] < lengths[:, None]  # B×Lq
    keys = key_lengths.to(q.device).long() if cross else lengths
    seen = visible_keys(keys, L, causal, sliding_window, Lq, symmetric_window) & valid_rows[:, None, :, None]
    return scores.masked_fill(~seen, float("-inf")).amax((-1, -2))


def bucket_index(token_class: torch.Tensor, lengths: torch.Tensor, num_windows: int,
                 Lq: int | None = None, first: int | None = None) -> torch.Tensor:
    """B×Lq×L int64 (Lq defaults to L): the distance-feature bucket of key t for query row i at position
    s = first + i (`first` defaults to L − Lq; cross-attention: 0) (docs/features.md).

    0..3: key class cls/sep/comma/period; 4: self (t == s, class OTHER); 5 + w: window w of
    d = |s − t| ≥ 1, w = floor(d · N / n). Padded positions get a bucket too; callers mask them.
    """
    B, L = token_class.shape
    Lq = L if Lq is None else Lq
    pos = torch.arange(L, device=token_class.device)
    rows = query_positions(Lq, L, token_class.device) if first is None else torch.arange(
        first, first + Lq, device=token_class.device)
    dist = (rows[:, None] - pos[None, :]).abs()  # Lq×L
    n = lengths.clamp(min=1).view(B, 1, 1)
    window = torch.div(dist[None] * num_windows, n, rounding_mode="floor").clamp(max=num_windows - 1)
    idx = 5 + window
    idx = torch.where(dist[None] == 0, torch.full_like(idx, 4), idx)
    key_cls = token_class[:, None, :].long().expand(B, Lq, L)
    special = (key_cls >= CLS) & (key_cls <= PERIOD)  # codes at padded positions are not checked
    # class codes CLS..PERIOD (1..4) map to buckets 0..3
    idx = torch.where(special, key_cls - 1, idx)
    return idx


def row_features(
    weights: torch.Tensor,
    lengths: torch.Tensor,
    token_class: torch.Tensor,
    sentence_id: torch.Tensor | None,
    num_windows: int,
    sink_weights: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    *,
    key_lengths: torch.Tensor | None = None,
    key_class: torch.Tensor | None = None,
    alignment: bool = False,
) -> torch.Tensor:
    """Per-(sample, head) feature vectors B×H×F (fp32) from final B×H×Lq×L weights; with `sink_weights`
    (B×H×Lq, each row's sink mass) one more feature, `sink`, comes next (its mean over the rows); with `grid`
    (B×L×2, an image's patch grid) IMAGE_FEATURES come next (`image_features`); with `alignment`, ALIGNMENT_FEATURES
    last (`alignment_features`).

    Query row i is key position s = L − Lq + i (`query_positions`); it is valid when s < n. Each valid row's
    features are defined as in a full forward, with n = the sample's length over the keys; the result is their
    mean over the sample's valid rows (n of them when Lq = L; a sample with none gets 0).

    Cross-attention (`key_lengths` given; module docstring): row i is position s = i, valid when i < lengths; the
    keys t < key_lengths, of classes `key_class` (B×L); `token_class` (B×Lq) marks the CLS rows."""
    B, H, Lq, L = weights.shape
    cross = key_lengths is not None
    first = 0 if cross else L - Lq  # the position of row 0
    n_keys = key_lengths if cross else lengths
    classes = key_class if cross else token_class
    if classes is None:
        classes = torch.full((B, L), OTHER, dtype=torch.int32, device=weights.device)
    w = weights.float()
    valid = _key_mask(n_keys, L)  # B×L
    w = torch.where(valid[:, None, None, :], w, 0.0)  # padded keys contribute nothing
    nb = 5 + num_windows
    idx = bucket_index(classes, n_keys, num_windows, Lq, first)[:, None].expand(B, H, Lq, L)
    buckets = torch.zeros(B, H, Lq, nb, dtype=torch.float32, device=w.device).scatter_add_(-1, idx, w)

    # row i (position s = first + i): w[i, s − 1] and w[i, s + 1], where those keys exist
    s = torch.arange(first, first + Lq, device=w.device)
    prev, nxt = (torch.where((t >= 0) & (t < L), w.gather(-1, t.clamp(0, L - 1).view(1, 1, Lq, 1).expand(
        B, H, Lq, 1))[..., 0], 0.0) for t in (s - 1, s + 1))
    entropy = -torch.special.xlogy(w, w).sum(-1)
    mx = w.amax(-1)
    if sentence_id is None:
        intra = w.sum(-1)
        inter = torch.zeros_like(intra)
    else:
        same = (sentence_id[:, L - Lq:, None] == sentence_id[:, None, :])[:, None]
        intra = (w * same).sum(-1)
        inter = (w * ~same).sum(-1)
    rows = torch.cat(
        [buckets, torch.stack([prev, nxt, entropy, mx, intra, inter], dim=-1)], dim=-1
    )  # B×H×Lq×(F-1), without the sink
    valid_rows = _key_mask(lengths, Lq) if cross else valid[:, L - Lq:]  # B×Lq
    row_valid = valid_rows[:, None, :, None]
    n = valid_rows.sum(-1).clamp(min=1).float().view(B, 1, 1)  # = lengths when Lq = L
    means = torch.where(row_valid, rows, 0.0).sum(2) / n  # padded rows (even NaN ones) add nothing

    row_class = token_class if cross else classes[:, L - Lq:]  # B×Lq (cross: the queries' classes, or none)
    is_cls_row = torch.zeros_like(valid_rows) if row_class is None else (row_class == CLS) & valid_rows
    n_cls = is_cls_row.sum(-1).float().view(B, 1)
    cls_ent = torch.where(is_cls_row[:, None, :], entropy, 0.0).sum(-1) / n_cls.clamp(min=1)
    parts = [means, cls_ent[..., None]]
    nan_rows = w.isnan().any(-1)
    if sink_weights is not None:
        sw = sink_weights.float()
        parts.append((torch.where(valid_rows[:, None, :], sw, 0.0).sum(-1) / n[..., 0])[..., None])
        nan_rows = nan_rows | sw.isnan()
    if grid is not None:
        parts.append(image_features(w, lengths, grid))
    if alignment:
        parts.append(alignment_features(w, lengths, key_lengths))
    out = torch.cat(parts, dim=-1)
    # NaN policy: a valid row with NaN weights makes every feature of its (sample, head) NaN
    nan_row = (nan_rows & valid_rows[:, None, :]).any(-1, keepdim=True)  # B×H×1
    out = torch.where(nan_row, float("nan"), out)
    assert out.shape[-1] == num_features(num_windows, sink=sink_weights is not None, grid=grid is not None,
                                         alignment=alignment)
    return out


def aligned_positions(lengths: torch.Tensor, Lq: int, L: int, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """B×Lq fp64: each query row's aligned key position p (docs/features.md, "Alignment features"). Self-attention:
    the row's own position s = L − Lq + i. Cross-attention (`key_lengths` nk given, `lengths` the query lengths nq):
    p = i·(nk − 1)/(nq − 1), first target token over the first source token and last over last (0 when nq = 1)."""
    i = torch.arange(Lq, device=lengths.device)
    if key_lengths is None:
        return (L - Lq + i).double()[None].expand(lengths.shape[0], Lq)
    nq, nk = lengths.long()[:, None], key_lengths.to(lengths.device).long()[:, None]
    return torch.where(nq > 1, (i[None] * (nk - 1)).double() / (nq - 1).clamp(min=1).double(), 0.0)


def alignment_features(weights: torch.Tensor, lengths: torch.Tensor,
                       key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """B×H×2 fp32, ALIGNMENT_FEATURES of B×H×Lq×L weights (docs/features.md, "Alignment features"): per valid row,
    `align_offset` = Σ_t w[i, t]·|t − p_i| and `align_near` = Σ_t w[i, t] over the keys |t − ⌊p_i + 1/2⌋| <= 1
    (p_i: `aligned_positions`), each averaged over the sample's valid rows (0 when it has none). Keys past the
    sample's keys count nothing; the weights are taken as given (a sink's mass is on no key)."""
    B, H, Lq, L = weights.shape
    cross = key_lengths is not None
    lengths = lengths.to(weights.device).long()
    n_keys = key_lengths.to(weights.device).long() if cross else lengths
    pos = aligned_positions(lengths, Lq, L, key_lengths)[:, None, :, None]  # B×1×Lq×1
    t = torch.arange(L, device=weights.device).double()
    offset = (t - pos).abs().float()  # B×1×Lq×L
    near = (t - torch.floor(pos + 0.5)).abs() <= 1
    w = torch.where(_key_mask(n_keys, L)[:, None, None, :], weights.float(), 0.0)
    per_row = torch.stack([(w * offset).sum(-1), torch.where(near, w, 0.0).sum(-1)], dim=-1)  # B×H×Lq×2
    rows = _key_mask(lengths, Lq) if cross else _key_mask(lengths, L)[:, L - Lq:]  # B×Lq: the valid rows
    count = rows.sum(-1).clamp(min=1).float().view(B, 1, 1)
    return torch.where(rows[:, None, :, None], per_row, 0.0).sum(2) / count


def mean_attention_distance(weights: torch.Tensor, lengths: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """B×H fp32: each head's mean attention distance in patch units (docs/features.md, "Image heads"): for each
    valid patch row s (at key position L − Lq + s), Σ_t w[s, t]·‖grid(s) − grid(t)‖ over the patch keys t < n,
    averaged over the sample's valid patch rows (0 when it has none). `weights` B×H×Lq×L, `grid` B×L×2 (row,
    col; −1 off the grid)."""
    return image_features(weights, lengths, grid)[..., 0]


def image_features(weights: torch.Tensor, lengths: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """B×H×(1 + len(RING_BOUNDS)) fp32, the features of IMAGE_FEATURES (docs/features.md, "Image heads"):
    `mean_attention_distance`, then for each ring [R_i, R_i+1) of RING_BOUNDS (the last one unbounded) the mass
    Σ w[s, t] over the patch keys t < n with R_i <= ‖grid(s) − grid(t)‖ < R_i+1, each averaged as the distance is
    over the sample's valid patch rows s (0 when it has none). The rings compare integer squared distances with
    squared bounds, so a key on a bound (distance 2, 4, 8) falls in the outer ring exactly."""
    B, H, Lq, L = weights.shape
    valid = _key_mask(lengths, L)
    pos = grid.to(weights.device).long()
    patch = (grid[..., 0] >= 0).to(weights.device) & valid  # B×L
    d2 = (pos[:, L - Lq:, None, :] - pos[:, None, :, :]).square().sum(-1)  # B×Lq×L, integer squared distances
    w = torch.where(patch[:, None, None, :], weights.float(), 0.0)  # the patch keys' weights
    dist = (w * d2.float().sqrt()[:, None]).sum(-1)  # B×H×Lq
    bounds = torch.tensor(RING_BOUNDS[1:], device=w.device).square()
    ring = torch.bucketize(d2, bounds, right=True)  # B×Lq×L: index of the ring holding each key
    rings = torch.zeros(B, H, Lq, len(RING_BOUNDS), dtype=torch.float32, device=w.device).scatter_add_(
        -1, ring[:, None].expand(B, H, Lq, L), w)
    per_row = torch.cat([dist[..., None], rings], dim=-1)  # B×H×Lq×(1 + rings)
    rows = patch[:, L - Lq:]  # B×Lq: the valid patch rows
    count = rows.sum(-1).clamp(min=1).float().view(B, 1, 1)
    return torch.where(rows[:, None, :, None], per_row, 0.0).sum(2) / count


@takes_params
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                        token_class: torch.Tensor | None = None, sentence_id: torch.Tensor | None = None,
                        **params) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention + interventions + features, computed in fp32.

    q: B×H×Lq×D; k, v: B×Hkv×L×D with L ≥ Lq (Lq < L: the queries are the last Lq positions, module docstring;
    any L with `key_lengths`: cross-attention). lengths: B (int, over the keys; cross-attention: over the queries).
    The other arguments are those of AttentionParams, by keyword.
    Returns (out B×Lq×H×D in q's dtype, features B×H×F fp32 — F = num_features(num_windows, sink=sink is not
    None, grid=grid is not None, alignment=alignment) — or B×H×0 when not wanted).
    """
    return params_attention(q, k, v, lengths, AttentionParams(token_class, sentence_id, **params))


def params_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     p: AttentionParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_attention` of the arguments `p` (checked here)."""
    B, H, L, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    if p.scaling is None and q.dim() == 4 and D >= 1:
        p = dataclasses.replace(p, scaling=D**-0.5)
    p.check(q, k, v, lengths)
    L = k.shape[2]  # the keys; q has Lq <= L rows (cross-attention: any Lq)
    lengths = lengths.to(q.device).long()
    key_lengths = p.key_lengths.to(q.device).long() if p.cross else lengths
    weights, sink_w = params_weights(q, k, lengths, p, return_sink=True)
    # padded keys of v are dropped, not multiplied by 0 (0 · NaN would leak garbage into valid rows)
    v_valid = v.float().masked_fill(~_key_mask(key_lengths, L)[:, None, :, None], 0.0)
    if v.shape[1] != H or p.kv_head is not None:
        v_valid = v_valid.index_select(1, resolve_kv_head(H, v.shape[1], p.kv_head, q.device))
    out = torch.matmul(weights, v_valid)  # B×H×L×D
    if p.gates is not None:
        out = out * p.gates.to(out.device, torch.float32).view(1, H, 1, 1)
    if p.mode is not None:  # a zeroed head outputs exactly 0, whatever v and the gate hold
        out = torch.where(p.mode.to(out.device).view(1, H, 1, 1) == ZERO, 0.0, out)
    out = out.transpose(1, 2).to(q.dtype)
    if p.want_features:
        token_class = p.token_class
        if token_class is None and not p.cross:
            token_class = torch.full((B, L), OTHER, dtype=torch.int32, device=q.device)
        fw = weights.detach()
        sw = None if sink_w is None else sink_w.detach()
        if p.key_scale is not None:
            fw = norm_weighted(fw, key_lengths, p.key_scale)
            if sw is not None:  # the sink adds no value vector: weight 0 under norm weighting (NaN stays NaN)
                sw = sw * 0.0
        cross = {"key_lengths": key_lengths, "key_class": p.key_class} if p.cross else {}
        feats = row_features(fw, lengths, token_class, p.sentence_id, p.num_windows, sw, p.grid,
                             alignment=bool(p.alignment), **cross)
    else:
        feats = q.new_zeros((B, H, 0), dtype=torch.float32)
    return out, feats


def norm_weighted(weights: torch.Tensor, lengths: torch.Tensor, key_scale: torch.Tensor) -> torch.Tensor:
    """w'[s, t] = w[s, t]·g[t] / Σ_u w[s, u]·g[u] for B×H×Lq×L weights and B×H×L key scales g (padded keys
    count 0; a row whose Σ is 0 stays 0; a NaN row stays NaN). Lq < L: the rows of a KV-cache step."""
    L = weights.shape[-1]  # the keys: a KV-cache step has fewer rows than keys
    g = key_scale.to(weights.device, torch.float32).masked_fill(~_key_mask(lengths, L)[:, None, :], 0.0)
    scaled = weights * g[:, :, None, :]
    total = scaled.sum(-1, keepdim=True)
    return torch.where(total > 0, scaled / total.clamp(min=torch.finfo(torch.float32).tiny), scaled)


def _require(ok: torch.Tensor, message) -> None:
    """Raise AttnkitError(message()) unless the bool tensor `ok` is true. While compiling, the check
    becomes a device-side assertion (no host read, no graph break)."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, "attnkit reference attention: invalid argument values")
    elif not bool(ok):
        raise AttnkitError(message())


def _first_bad(bad: torch.Tensor) -> str:
    """'[i, j]' of the first True of a bool tensor."""
    idx = bad.nonzero()[0].tolist()
    return "[" + ", ".join(map(str, idx)) + "]"


# (the usual dtypes of an integer argument: `_int_tensor` asks nothing more of them, once per argument of every call)
_INTEGER_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


def _int_tensor(t, name, shape) -> None:
    if not isinstance(t, torch.Tensor):
        raise AttnkitError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _INTEGER_DTYPES and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise AttnkitError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.shape != shape:
        raise AttnkitError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def check_arguments(q, k, v, lengths, token_class=None, sentence_id=None, **params) -> None:
    """`AttentionParams.check` for arguments given as keywords."""
    AttentionParams(token_class, sentence_id, **params).check(q, k, v, lengths)


__all__ = [
    "reference_attention",
    "params_attention",
    "params_weights",
    "norm_weighted",
    "check_arguments",
    "AttentionParams",
    "reference_js_distances",
    "attention_weights",
    "attention_scores",
    "max_logits",
    "visible_keys",
    "resolve_kv_head",
    "intervene_weights",
    "row_features",
    "mean_attention_distance",
    "image_features",
    "bucket_index",
    "KEEP",
    "SEP",
    "COMMA",
    "PERIOD",
]


def reference_js_distances(attn: torch.Tensor, lengths: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """M×M fp64 Σ_b Σ_{s<n_b} JS(attn[b,i,s,:], attn[b,j,s,:]) (natural logs, 0·log 0 = 0).

    attn: B×M×L×L attention rows (padded keys 0); lengths: B. Pure PyTorch, chunked over heads i so
    that at most chunk×M×L×L values exist at once (the executable spec of the js_distances op).
    """
    B, M, L, _ = attn.shape
    a = attn.double()
    rows = torch.arange(L, device=attn.device)[None, :] < lengths.to(attn.device).view(B, 1)  # B×L
    out = torch.zeros(M, M, dtype=torch.float64, device=attn.device)
    for b in range(B):
        p_all = a[b][:, rows[b]]  # M×n×L
        for i0 in range(0, M, chunk):
            p = p_all[i0:i0 + chunk, None]  # c×1×n×L
            q = p_all[None]  # 1×M×n×L
            m = (p + q) / 2
            kl_p = torch.special.xlogy(p, p) - torch.special.xlogy(p, m)
            kl_q = torch.special.xlogy(q, q) - torch.special.xlogy(q, m)
            out[i0:i0 + chunk] += (0.5 * (kl_p + kl_q)).sum((-1, -2))
    return out


def replace_head_outputs(out: torch.Tensor, outputs: dict, rows: slice = slice(None)) -> torch.Tensor:
    """Patch and mean (docs/interventions.md): `out` (B×L×H×D, the op's per-head outputs) with the output of each
    head h in `outputs` replaced, for the samples `rows`, by outputs[h] (broadcast to those samples × L × D) at
    every position. Applied after the op, so the weights (and the features) of those heads are the ones they
    computed; a gate on such a head has no effect. In place, unless autograd tracks `out`."""
    if not outputs:
        return out
    if out.requires_grad:
        out = out.clone()
    for h, v in outputs.items():
        out[rows, :, h, :] = v
    return out
