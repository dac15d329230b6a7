"""The attnkit operators: loading the compiled extension, fake kernels, autograd, backend choice.

`torch.ops.attnkit.fused_attention` is defined in csrc/ops.cpp (TORCH_LIBRARY) with C++/CUDA kernels.
Here we register what PyTorch needs around it (a fake kernel for torch.compile / meta tensors, and
autograd), and `attention()` picks the fused op or the pure-PyTorch reference.

Autograd: the gradient w.r.t. q, k, v, gates (head importance, Michel et al.) and sink logits comes, without an
intervention, from attnkit.kernels.backward, which never builds an L×L map (ATen's CPU flash backward, or a
query-tiled backward in PyTorch; docs/training.md). Under an intervention (mode, region, renormalize) it is
computed by re-running the differentiable reference, at the reference's L×L memory. The features output is not
differentiable (it has no grad_fn): a loss on features raises instead of getting zero gradients.

torch.compile: which kernels exist is decided once per (device type, op) outside the traced path
(`has_kernel` reads a table), so `attention()` traces without graph breaks.

Decoder arguments (kv_head, causal, sliding_window, softcap, sink; attnkit/reference.py): they are appended to
the op's schema with defaults. An extension built before them has no such arguments (`fused_decoder()` is
False): `backend="auto"` then runs such calls on the reference, and `backend="fused"` refuses them by name.

A bidirectional sliding window (`symmetric_window`, ModernBERT's local layers; attnkit/reference.py) runs on the
compiled CPU kernel of a build that takes it (`fused_symmetric_window`); on CUDA, the Triton kernel included, and on
older builds, `backend="auto"` runs it on the reference (exact, no warning: docs/cuda.md) and `backend="fused"`
refuses it by name.

Fewer queries than keys (a KV-cache step, attnkit/reference.py): `backend="auto"` runs them on the compiled CPU
kernel only where it says it takes them (`fused_fewer_queries`), else on the reference; on CUDA, the Triton kernel
included, always on the reference until a GPU has tested a kernel (docs/cuda.md). A plain one (no features, no
intervention, no soft cap or sink: `plain_step`) the reference's definition computes in one call of torch's
scaled_dot_product_attention. The fake kernel's shapes hold for them (out B×Lq×H×D).

An image's patch grid (`grid`, attnkit/reference.py "Images"): only the compiled CPU kernel (of a build that says so,
`fused_grid`) measures its features; with features wanted, CUDA calls (the Triton kernel's too) and older builds run
on the reference, and `backend="fused"` refuses them by name; without features the grid is dropped (it changes
nothing else). A grid
with cross-attention is refused by name (attnkit/reference.py).

The alignment features (`alignment`, attnkit/reference.py "Alignment"): only the compiled CPU kernel (of a build that
says so, `fused_alignment`) measures them; with features wanted, CUDA calls (the Triton kernel's too) and older
builds run on the reference, and `backend="fused"` refuses them by name; without features `alignment` is dropped.

Cross-attention (`key_lengths`, attnkit/reference.py, "Cross-attention") runs on the compiled CPU kernel where it says
it takes it (`fused_cross`), else on the reference; on CUDA and Triton always on the reference until a GPU has tested
a kernel (docs/cuda.md). An additive `bias` (T5's position_bias) likewise: the compiled CPU kernel adds it to its
scores where it says so (`fused_bias`), CUDA calls run on the reference. Their
backward is the differentiable reference's (the bias gets a gradient). `fused_attention_lse` takes neither (its
schema: the arguments before key_lengths, then symmetric_window, want_max_logit, grid and alignment). A bidirectional
window with
cross-attention is refused by name (a window over another sequence is undefined).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading

import torch

from .errors import MAX_NUM_WINDOWS, AttnkitError, arg
from .features import num_features
from .reference import AttentionParams, params_attention, takes_params, visible_keys

log = logging.getLogger("attnkit")

_EXT_ERROR: BaseException | None = None
if os.environ.get("ATTNKIT_NO_EXT") == "1":  # run on the reference, e.g. to rule the extension out
    _EXT_ERROR = ImportError("disabled by ATTNKIT_NO_EXT=1")
else:
    try:  # importing the extension runs its TORCH_LIBRARY registrations
        importlib.import_module("attnkit._C")
    except Exception as exc:  # ImportError, or an undefined symbol from a torch mismatch
        _EXT_ERROR = exc

BACKENDS = ("auto", "fused", "reference")
_warned = threading.Event()
_OP = "attnkit::fused_attention"
_JS_OP = "attnkit::js_distances"
# the op that also returns each row's log-sum-exp (csrc/ops.cpp; CPU kernel only), for the training path's backward
_LSE_OP = "attnkit::fused_attention_lse"


def extension_loaded() -> bool:
    return _EXT_ERROR is None


def _query_kernel(device_type: str, op: str) -> bool:
    if not extension_loaded():
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    try:
        return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # an extension built before `op` existed does not define it
        return False


# (device type, op) -> kernel registered? Filled at import (the extension's registrations do not change
# afterwards), so the per-call check is a dict lookup that torch.compile traces as a constant.
_KERNELS: dict[tuple[str, str], bool] = {
    (dev, op): _query_kernel(dev, op) for dev in ("cpu", "cuda") for op in (_OP, _JS_OP)
}


def has_kernel(device_type: str, op: str = _OP) -> bool:
    """True when the compiled extension has a kernel for `op` on this device type ("cpu"/"cuda")."""
    key = (device_type, op)
    if key not in _KERNELS:  # another op or device type: ask the dispatcher once
        _KERNELS[key] = _query_kernel(device_type, op)
    return _KERNELS[key]


def _op_takes(op: str, argument: str) -> bool:
    """Whether the compiled `torch.ops.attnkit.<op>` has `argument` in its schema (older builds lack later ones)."""
    try:
        names = {a.name for a in getattr(torch.ops.attnkit, op).default._schema.arguments}
    except (AttributeError, RuntimeError):
        return False
    return argument in names


def _schema_has_decoder_args() -> bool:
    return extension_loaded() and _op_takes("fused_attention", "causal")


_FUSED_DECODER = _schema_has_decoder_args()
# the compiled op takes `symmetric_window`, the last argument of AttentionParams: its schema is then the whole of it
_FUSED_SYMMETRIC = extension_loaded() and _op_takes("fused_attention", "symmetric_window")


def _lse_op_has_max_logit() -> bool:
    """Whether the compiled `_LSE_OP` takes `want_max_logit` and returns each head's max logit (csrc/ops.cpp): the
    CPU kernel then measures it while it runs. An extension built before it returns (out, features, lse) only."""
    return has_kernel("cpu", _LSE_OP) and _op_takes("fused_attention_lse", "want_max_logit")


def fused_symmetric_window(device_type: str) -> bool:
    """Whether the compiled kernel for `device_type` takes a bidirectional sliding window (`symmetric_window`): the
    CPU kernel of a build that has the argument. On CUDA (and the Triton kernel) no: such calls run on the reference
    until a GPU has tested a kernel (docs/cuda.md)."""
    return device_type == "cpu" and _FUSED_SYMMETRIC


_LSE_MAX_LOGIT = _lse_op_has_max_logit()


def fused_max_logit(device_type: str) -> bool:
    """Whether the compiled kernel for `device_type` returns each head's max logit from the attention call itself
    (docs/features.md §9): the CPU kernel of a build whose `attnkit::fused_attention_lse` takes `want_max_logit`.
    Elsewhere (CUDA, Triton, the reference, older builds) `attention(..., want_max_logit=True)` computes it by
    `attnkit.kernels.statistics.max_logits`, one more blocked q·kᵀ pass."""
    # (and only a build whose schemas take symmetric_window: autograd reads the lse op's inputs back by position,
    # and want_max_logit follows symmetric_window there)
    return device_type == "cpu" and _LSE_MAX_LOGIT and _FUSED_SYMMETRIC


# a build that takes grid after cross-attention's arguments (csrc/ops.cpp; grid comes last in `op_args`)
_FUSED_GRID = (extension_loaded() and _op_takes("fused_attention", "grid")
               and _op_takes("fused_attention", "key_lengths"))


def _cpu_says(flag: str) -> bool:
    """Whether the compiled CPU kernel says it has a capability: an extension with one defines the op
    `attnkit::<flag>() -> bool` (csrc/ops.cpp); one built before it has no such op, and has not."""
    if not has_kernel("cpu"):
        return False
    try:
        return bool(getattr(torch.ops.attnkit, flag)())
    except (AttributeError, RuntimeError):
        return False


# every feature of an image's patch grid (IMAGE_FEATURES: the mean attention distance and the ring masses); a build
# before the rings measured the distance alone, and grids do not run on it
_CPU_GRID = _FUSED_GRID and _cpu_says("cpu_grid_rings")


def fused_grid(device_type: str) -> bool:
    """Whether the compiled kernel for `device_type` measures the features of an image's patch grid (`grid`,
    IMAGE_FEATURES): the CPU kernel of a build that takes the grid and measures the ring masses. The CUDA kernels do
    not (docs/cuda.md): such calls run on the reference there (exact, at its L×L memory per call)."""
    return device_type == "cpu" and _CPU_GRID


# a build that takes `alignment` (after grid) and whose CPU kernel measures the alignment features
_FUSED_ALIGNMENT = extension_loaded() and _op_takes("fused_attention", "alignment")
_CPU_ALIGNMENT = _FUSED_ALIGNMENT and _FUSED_GRID and _cpu_says("cpu_alignment")


def fused_alignment(device_type: str) -> bool:
    """Whether the compiled kernel for `device_type` measures the alignment features (`alignment`,
    ALIGNMENT_FEATURES): the CPU kernel of a build that says so. The CUDA kernels do not (docs/cuda.md): such calls
    run on the reference there."""
    return device_type == "cpu" and _CPU_ALIGNMENT


def fused_decoder() -> bool:
    """True when the compiled op takes the decoder arguments (kv_head, causal, sliding_window, softcap, sink)."""
    return _FUSED_DECODER


# fewer queries than keys (q B×H×Lq×D, k B×Hkv×L×D, Lq < L: the last Lq positions, attnkit/reference.py)
_CPU_FEWER_QUERIES = _cpu_says("cpu_fewer_queries")
# cross-attention (`key_lengths`, `key_class`)
_CPU_CROSS = _op_takes("fused_attention", "key_lengths") and _cpu_says("cpu_cross_attention")


_CPU_BIAS = _CPU_CROSS and _cpu_says("cpu_bias")


def fused_bias(device_type: str) -> bool:
    """Whether the compiled kernel for `device_type` adds an additive bias (T5's position_bias) to its scores: the
    CPU kernel of a build that says so. On CUDA (and the Triton kernel) no: those run on the reference until a GPU
    has tested a kernel (docs/cuda.md)."""
    return device_type == "cpu" and _CPU_BIAS


def fused_cross(device_type: str) -> bool:
    """Whether the compiled kernel for `device_type` runs cross-attention. On CUDA (and the Triton kernel) no: those
    run on the reference until a GPU has tested a kernel (docs/cuda.md)."""
    return device_type == "cpu" and _CPU_CROSS


def fused_fewer_queries(device_type: str) -> bool:
    """Whether the compiled kernel for `device_type` runs calls with fewer queries than keys (a KV-cache step). On
    CUDA (and the Triton kernel) no: those run on the reference until a GPU has tested a kernel (docs/cuda.md)."""
    return device_type == "cpu" and _CPU_FEWER_QUERIES


def cpu_capability() -> str | None:
    """The build of the CPU kernel that runs now: "default", "avx2" or "avx512" (docs/cuda.md, "CPU capability":
    torch's CPU capability, or $ATTNKIT_CPU_CAPABILITY); None without a compiled CPU kernel that reports it."""
    if not has_kernel("cpu"):
        return None
    try:
        return torch.ops.attnkit.cpu_capability()
    except AttributeError:  # an extension built before the capability builds
        return None
    except RuntimeError as exc:
        raise AttnkitError(str(exc).strip().splitlines()[0]) from None


def cpu_capabilities() -> list[str]:
    """The instruction sets this CPU supports among the CPU kernel's builds, best first ("avx512", "avx2",
    "default"; from /proc/cpuinfo, so on other systems only "default"): what ATTNKIT_CPU_CAPABILITY may force."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        flags = set()
    caps = ["default"]
    if {"avx2", "fma"} <= flags:
        caps.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            caps.append("avx512")
    return caps[::-1]


CUDA_KERNELS = ("v1", "v2", "triton")


def cuda_kernel() -> str:
    """The CUDA kernel ATTNKIT_CUDA_KERNEL names for fp16/bf16 inputs (read at every call, so a benchmark can switch
    inside one process): "v1" (the default), "v2" (C++, docs/cuda.md) or "triton" (`attnkit/kernels/`)."""
    name = os.environ.get("ATTNKIT_CUDA_KERNEL") or "v1"
    if name not in CUDA_KERNELS:
        raise AttnkitError(f"ATTNKIT_CUDA_KERNEL must be 'v1', 'v2' or 'triton', got {name!r}")
    return name


def _warn_reference_once() -> None:
    if not _warned.is_set():
        _warned.set()
        reason = f"{type(_EXT_ERROR).__name__}: {_EXT_ERROR}" if _EXT_ERROR else "no kernel for this device"
        log.warning(
            "attnkit: fused extension not available (%s); using the slower PyTorch reference backend. "
            "Build it with `pip install --no-build-isolation -e .`.",
            reason,
        )


def backend_info() -> str:
    """Which backend `backend="auto"` uses: "fused-cuda", "fused-cpu" or "reference"."""
    if has_kernel("cuda") and torch.cuda.is_available():
        return "fused-cuda"
    if has_kernel("cpu"):
        return "fused-cpu"
    return "reference"


def backend_label(backend: str, device) -> str:
    """The backend that runs for tensors on `device`: "fused-cpu", "fused-cuda" or "reference"."""
    dev = torch.device(device)
    return f"fused-{dev.type}" if resolve_backend(backend, dev) == "fused" else "reference"


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map "auto"/"fused"/"reference" to "fused" or "reference" for tensors on `device`."""
    device_type = torch.device(device).type
    if backend not in BACKENDS:
        raise AttnkitError(f"unknown {arg('backend')} {backend!r}: use 'auto', 'fused' or 'reference'")
    if backend == "reference":
        return "reference"
    if has_kernel(device_type):
        return "fused"
    if backend == "fused":
        why = f" ({_EXT_ERROR})" if _EXT_ERROR else ""
        raise AttnkitError(f"backend 'fused' requested but the extension has no {device_type} kernel{why}")
    if not torch.compiler.is_compiling():
        _warn_reference_once()
    return "reference"


@takes_params
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
              token_class: torch.Tensor | None = None, sentence_id: torch.Tensor | None = None, *,
              backend: str = "auto", want_max_logit: bool = False, **params) -> tuple[torch.Tensor, ...]:
    """Attention with optional interventions and features; see `attnkit.reference` for semantics. `params`: the
    op's other arguments, by keyword (the fields of `attnkit.reference.AttentionParams`).

    `key_scale` (B×H×L, ≥ 0): the features describe the weights each scaled by its key's factor and
    renormalised per row (norm weighting, docs/features.md); the output is unchanged.
    Decoder arguments: k and v may have fewer heads (`kv_head`: the KV head of each query head), `causal`,
    `sliding_window`, `softcap`, `sink` (a logit per head; adds the feature `sink`).
    Returns (out B×L×H×D, features B×H×F fp32 — B×H×0 when `want_features` is false); with `want_max_logit`, also
    each head's max logit per sample (B×H fp32, no gradient; docs/features.md §9, `attnkit.reference.max_logits`):
    from the CPU kernel's own pass where it measures it (`fused_max_logit`: no intervention mode; KV-cache steps
    included), else from `attnkit.kernels.statistics.max_logits` (one more blocked q·kᵀ pass). A step's rows count
    at their true positions; a sample with no valid row has −inf.
    """
    p = AttentionParams.of(token_class, sentence_id, **params)
    direct = None if want_max_logit else _direct_args(q, k, v, lengths, p, backend)
    if direct is not None:
        try:
            return torch.ops.attnkit.fused_attention(q, k, v, lengths, *direct)
        except Exception:  # noqa: BLE001,S110 (refused: the checked path below refuses it with its own message)
            pass
    res = _attention(q, k, v, lengths, p, backend, _max_logit=want_max_logit)
    if not want_max_logit or len(res) == 3:
        return res
    from .kernels.statistics import max_logits

    scale = q.shape[-1] ** -0.5 if p.scaling is None else p.scaling
    kvh = None if p.kv_head is None else p.kv_head.to(q.device)
    return (*res, max_logits(q, k, lengths, scale, kv_head=kvh, causal=p.causal, sliding_window=p.sliding_window,
                             key_lengths=p.key_lengths, symmetric_window=p.symmetric_window))


# the tensor arguments in the dtypes the compiled op's schema takes; gates, sink and bias that need a gradient keep
# theirs, so that autograd reaches them
_KERNEL_DTYPES = (("token_class", torch.int32), ("sentence_id", torch.int32), ("mode", torch.int32),
                  ("region", torch.int32), ("gates", torch.float32), ("key_scale", torch.float32),
                  ("kv_head", torch.int32), ("sink", torch.float32), ("key_lengths", torch.int64),
                  ("key_class", torch.int32), ("bias", torch.float32), ("grid", torch.int32))
_KEEP_GRADIENT = frozenset({"gates", "sink", "bias"})


def _kernel_scalars(p: AttentionParams, q: torch.Tensor) -> dict:
    """The scalar arguments as the kernels take them: scaling resolved, causal a bool, softcap a float, alignment
    only with features (without them it changes nothing). `_for_kernels` and `_direct_args` apply them."""
    return {"scaling": q.shape[-1] ** -0.5 if p.scaling is None else p.scaling, "causal": bool(p.causal),
            "softcap": None if p.softcap is None else float(p.softcap),
            "alignment": bool(p.alignment) and bool(p.want_features)}


def _for_kernels(p: AttentionParams, q: torch.Tensor) -> AttentionParams:
    """The arguments in the dtypes the compiled op's schema takes (`_KERNEL_DTYPES`), on q's device, and the
    scalars as `_kernel_scalars` gives them. Only the tensors given and not already so are converted: this runs on
    every attention call."""
    dev = q.device
    changes = _kernel_scalars(p, q)
    if not p.want_features:
        changes["grid"] = None  # (nor the grid)
    given = p.__dict__
    for name, dtype in _KERNEL_DTYPES:
        t = given[name]
        if t is None or name in changes:
            continue
        if name in _KEEP_GRADIENT and t.requires_grad:
            if t.device != dev:
                changes[name] = t.to(dev)
        elif t.dtype != dtype or t.device != dev:
            changes[name] = t.to(device=dev, dtype=dtype)
    return p.replaced(**changes)


def _cpu_takes_all() -> bool:
    """Whether the CPU kernel takes every argument of AttentionParams, so that `_attention` would route no CPU call
    elsewhere: read at each call from the same flags `_attention` reads."""
    return (has_kernel("cpu") and _FUSED_DECODER and _FUSED_CROSS and _FUSED_GRID and _FUSED_ALIGNMENT
            and fused_symmetric_window("cpu") and fused_fewer_queries("cpu") and fused_cross("cpu")
            and fused_bias("cpu") and fused_grid("cpu") and fused_alignment("cpu"))


def _direct_args(q, k, v, lengths, p: AttentionParams, backend: str) -> tuple | None:
    """The compiled CPU op's arguments after lengths for a call that `_attention` would send to it unchanged, else
    None: backend "auto" or "fused", a build whose CPU kernel takes every argument, plain CPU tensors already in the
    schema's dtypes (`_KERNEL_DTYPES`; lengths int64), no gradient wanted, scalars of the types `check_layout` takes,
    and not while torch.compile or torch.jit traces the call. Such a call skips `check_layout`, the conversions and
    the routing, a visible part of a short call's time (bench/README.md, "The direct path"): the kernel checks
    every shape, dtype and value that `check_layout` checks of such arguments, and when it refuses them,
    `attention` runs the checked path, which refuses them with its own message. tests/test_op_direct.py holds both
    paths to the same bits and errors."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or not (type(q) is torch.Tensor and q.is_cpu and q.dim() == 4 and q.shape[3] > 0
                    and type(lengths) is torch.Tensor and lengths.dtype is torch.int64 and lengths.is_cpu
                    and (backend == "auto" or backend == "fused"))):
        return None
    f = p.__dict__  # (the fields, read without a getattr each: this runs on every call)
    num_windows, window, softcap, scaling = f["num_windows"], f["sliding_window"], f["softcap"], f["scaling"]
    if (type(num_windows) is not int or num_windows > MAX_NUM_WINDOWS
            or (window is not None and type(window) is not int)
            or (softcap is not None and type(softcap) not in (float, int))
            or (scaling is not None and type(scaling) not in (float, int))
            or type(f["alignment"]) is not bool or type(f["symmetric_window"]) is not bool
            # a grid without features: the checked path checks its shape, then does not pass it on
            or (f["grid"] is not None and not f["want_features"])):
        return None
    grad = torch.is_grad_enabled()
    if grad and (q.requires_grad or type(k) is not torch.Tensor or k.requires_grad
                 or type(v) is not torch.Tensor or v.requires_grad):
        return None
    for name, dtype in _KERNEL_DTYPES:
        t = f[name]
        if t is not None and (type(t) is not torch.Tensor or t.dtype is not dtype or not t.is_cpu
                              or (grad and t.requires_grad)):
            return None
    if not _cpu_takes_all():
        return None
    return p.replaced(**_kernel_scalars(p, q)).op_args()


# the op's arguments before the decoder ones: all that a build before them takes; those before cross-attention's:
# all that a build before it takes, and the first of what `_LSE_OP` takes (then symmetric_window, want_max_logit,
# grid, alignment); those before symmetric_window, before grid and before alignment: all that a build before each takes
_BEFORE_DECODER = AttentionParams.position("kv_head") - 4
_BEFORE_CROSS = _LSE_PARAMS = AttentionParams.position("key_lengths") - 4
_BEFORE_SYMMETRIC = AttentionParams.position("symmetric_window") - 4
_BEFORE_GRID = AttentionParams.position("grid") - 4
_BEFORE_ALIGNMENT = AttentionParams.position("alignment") - 4
_FUSED_CROSS = extension_loaded() and _op_takes("fused_attention", "key_lengths")


def _compiled_args(p: AttentionParams) -> tuple:
    """`p.op_args()` as the compiled `_OP`'s schema takes them by position: a build before the decoder arguments,
    before cross-attention's, before symmetric_window, before `grid` or before `alignment` has no such arguments
    (`_attention` has sent calls that use them to the reference)."""
    args = p.op_args()
    if not _FUSED_DECODER:
        return args[:_BEFORE_DECODER]
    if not _FUSED_CROSS:
        return args[:_BEFORE_CROSS]
    if not _FUSED_SYMMETRIC:
        return args[:_BEFORE_SYMMETRIC]
    if not _FUSED_GRID:
        return args[:_BEFORE_GRID]
    return args if _FUSED_ALIGNMENT else args[:_BEFORE_ALIGNMENT]


def _lse_call(q, k, v, lengths, p: AttentionParams, want_max_logit: bool):
    """`_LSE_OP` on the arguments `p`: its schema takes the arguments before key_lengths (cross-attention and a bias
    never run on it), then symmetric_window, want_max_logit, grid and alignment (csrc/ops.cpp), the last three by
    keyword here (a build before one has no such argument, and is not given it). Only for a build that takes
    symmetric_window (`_FUSED_SYMMETRIC`: `saves_lse` and `fused_max_logit` ask for it)."""
    kw = {"want_max_logit": True} if want_max_logit else {}
    if p.grid is not None:
        kw["grid"] = p.grid
    if p.alignment:
        kw["alignment"] = True
    return torch.ops.attnkit.fused_attention_lse(q, k, v, lengths, *p.op_args()[:_LSE_PARAMS],
                                                 bool(p.symmetric_window), **kw)


def _attention(q, k, v, lengths, p: AttentionParams, backend: str, _max_logit=False) -> tuple[torch.Tensor, ...]:
    """`attention` without `want_max_logit`; `_max_logit`: where the fused CPU kernel measures the max logit, it is
    returned as a third output (else the caller computes it)."""
    # shapes and dtypes as the reference checks them, before anything is converted: the backends agree on
    # every input the reference accepts, and refuse (not round) what it refuses, e.g. float lengths or D = 0
    p.check_layout(q, k, v, lengths)
    dev = q.device
    lengths = lengths.to(device=dev, dtype=torch.int64)
    p = _for_kernels(p, q)
    # a KV-cache step: the queries are the last positions of the keys (cross-attention's are another sequence)
    fewer_queries = q.shape[2] < k.shape[2] and not p.cross
    if (backend in ("auto", "fused") and dev.type == "cuda" and q.dtype in _TRITON_DTYPES and cuda_kernel() == "triton"
            and not fewer_queries and not p.cross and p.bias is None and not p.symmetric_window
            and p.grid is None and not p.alignment):
        # the Triton kernel takes every argument, the decoder ones included, and needs no compiled extension
        return torch.ops.attnkit.fused_attention_triton(q, k, v, lengths, *p.op_args())
    chosen = resolve_backend(backend, dev)
    decoder = p.decoder_used(q.shape[1], k.shape[1]) if chosen == "fused" and not _FUSED_DECODER else ()
    if decoder:
        if backend == "fused":
            raise AttnkitError(f"backend 'fused' requested but this build of the extension does not take "
                               f"{', '.join(decoder)}: rebuild it (pip install --no-build-isolation -e .)")
        chosen = "reference"  # an older build: the reference computes them (no warning: the result is exact)
    if chosen == "fused" and fewer_queries and not fused_fewer_queries(dev.type):
        if backend == "fused":
            raise AttnkitError(f"backend 'fused' requested but the {dev.type} kernel does not take fewer queries than "
                               f"keys ({q.shape[2]} queries, {k.shape[2]} keys: a KV-cache step); use backend "
                               "'auto' or 'reference'")
        chosen = "reference"  # a decode step costs the reference O(keys) per head and query row (exact, no warning)
    if chosen == "fused" and ((p.bias is not None and not fused_bias(dev.type))
                              or (p.cross and not fused_cross(dev.type))):
        what = ("an additive bias" if p.bias is not None and not fused_bias(dev.type)
                else "cross-attention (key_lengths)")
        if backend == "fused":
            raise AttnkitError(f"backend 'fused' requested but the {dev.type} kernel does not take {what}; use "
                               "backend 'auto' or 'reference'")
        chosen = "reference"  # exact, no warning (docs/cuda.md)
    if chosen == "fused" and p.symmetric_window and not fused_symmetric_window(dev.type):
        if backend == "fused":
            rebuild = ", or rebuild it (pip install --no-build-isolation -e .)" if dev.type == "cpu" else ""
            raise AttnkitError(f"backend 'fused' requested but the {dev.type} kernel of this build does not take "
                               f"symmetric_window (a bidirectional sliding window); use backend 'auto' or "
                               f"'reference'{rebuild}")
        chosen = "reference"  # (exact, no warning: docs/cuda.md)
    if chosen == "fused" and p.grid is not None and not fused_grid(dev.type):
        if backend == "fused":
            raise AttnkitError(f"backend 'fused' requested but the {dev.type} kernel of this build does not measure "
                               "the features of an image's patch grid (grid: the distance and the ring masses): use "
                               "backend 'auto' or 'reference'")
        chosen = "reference"  # exact, no warning (docs/cuda.md: the CUDA kernels do not take the grid)
    if chosen == "fused" and p.alignment and not fused_alignment(dev.type):
        if backend == "fused":
            raise AttnkitError(f"backend 'fused' requested but the {dev.type} kernel of this build does not measure "
                               "the alignment features (alignment): use backend 'auto' or 'reference'")
        chosen = "reference"  # exact, no warning (docs/cuda.md: the CUDA kernels do not measure them)
    if chosen == "reference" and fewer_queries and backend == "auto" and _plain_step(q, k, v, p):
        return plain_step(q, k, v, lengths, p.scaling, p.causal, p.sliding_window)
    if chosen == "reference":
        return params_attention(q, k, v, lengths, p)
    try:
        lse = saves_lse(q, k, v, p)
        # (a step here: the kernel takes it; cross-attention does not run on `_LSE_OP`)
        in_op = _max_logit and p.mode is None and fused_max_logit(dev.type) and not p.cross
        if lse or in_op:
            # training: the op also returns each row's log-sum-exp, which its backward uses instead of recomputing
            # the attention forward (docs/training.md, "The backward"); with `in_op`, each head's max logit too.
            # Gates multiply the op's ungated output here, so that the saved output is the one ATen's backward
            # wants and autograd gives the gate Σ dO ∘ O_h (no recompute)
            ungated = dataclasses.replace(p, gates=None) if lse else p
            res = _lse_call(q, k, v, lengths, ungated, in_op)
            out = res[0]
            if lse and p.gates is not None:
                out = (out.float() * p.gates.float().view(1, 1, -1, 1)).to(out.dtype)
            return (out, res[1], res[3]) if in_op else (out, res[1])
        return torch.ops.attnkit.fused_attention(q, k, v, lengths, *_compiled_args(p))
    except RuntimeError as exc:  # the kernels' argument checks (TORCH_CHECK) name the bad argument
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "fused_attention" in msg:
            raise AttnkitError(msg) from None
        raise


def saves_lse(q, k, v, p: AttentionParams) -> bool:
    """Whether a fused CPU call runs `_LSE_OP` so that its backward reuses the saved output and log-sum-exp: a
    gradient is wanted, the extension has the op (in a build whose schemas take symmetric_window: `_setup_context`
    reads the op's inputs back by position), and the backward is ATen's with nothing between the
    softmax and the output — no intervention (mode, region, renormalize), as many queries as keys, and ATen's case
    (`kernels.backward.uses_aten`: no sliding window, soft-cap or sink). Gates are allowed: the op then runs
    ungated, which is the output ATen's backward wants, and `attention` multiplies by the gates outside it. Every
    other call keeps `_OP`, and its backward recomputes what it needs."""
    if not (torch.is_grad_enabled() and q.device.type == "cpu"):  # (inference: no import per call)
        return False
    from .kernels.backward import uses_aten

    return (any(t is not None and t.requires_grad for t in (q, k, v, p.gates, p.sink))
            and p.mode is None and p.region is None and not p.renormalize and q.shape[2] == k.shape[2]
            and not p.cross and p.bias is None
            and uses_aten(q, p.sliding_window, p.softcap, p.sink) and _FUSED_SYMMETRIC and has_kernel("cpu", _LSE_OP))


def _plain_step(q, k, v, p: AttentionParams) -> bool:
    """Whether a call with fewer queries than keys is plain attention (`plain_step` computes it): fp32, no
    features, no intervention, even KV groups, no soft cap, no sink, no bias (T5's step), no gradients."""
    return (q.dtype == torch.float32 and not p.want_features and p.mode is None and p.region is None
            and p.gates is None and p.kv_head is None and p.softcap is None and p.sink is None
            and not p.symmetric_window and p.bias is None
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


def plain_step(q, k, v, lengths, scaling: float, causal: bool, sliding_window) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's result for plain attention (no features, no intervention, no soft cap, no sink) with fewer
    queries than keys — a step of generation — in one call of torch's scaled_dot_product_attention instead of the
    reference's twenty small operations: the keys each row sees (`visible_keys`) as the mask, padded keys of v
    dropped as the reference drops them, and a row that sees no key output 0 (sdpa would give NaN)."""
    B, H, Lq, D = q.shape
    L = k.shape[2]
    lengths = lengths.long()
    empty = q.new_zeros((B, H, 0), dtype=torch.float32)
    gqa = k.shape[1] != H
    if (Lq == 1 and causal and (sliding_window is None or sliding_window >= L) and q.device.type == "cpu"
            and not torch.compiler.is_compiling() and bool((lengths == L).all())):
        # the usual decode step: one new token of unpadded samples sees every key
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2), empty
    visible = visible_keys(lengths, L, causal, sliding_window, Lq)  # B×1×Lq×L
    padded = torch.arange(L, device=v.device)[None, :] >= lengths[:, None]  # B×L
    v = v.masked_fill(padded[:, None, :, None], 0.0)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scaling,
                                                           enable_gqa=gqa)
    if sliding_window is not None:  # only a window can leave a (padded) row without a key
        out = torch.where(visible.any(-1, keepdim=True), out, 0.0)
    return out.transpose(1, 2), empty


def js_distances(attn: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """M×M fp64 sums of JS(attn[b,i,s,:], attn[b,j,s,:]) over samples b and valid rows s (fused op)."""
    return torch.ops.attnkit.js_distances(attn.float().contiguous(), lengths.to(attn.device, torch.int64))


# --- registrations around the schemas -----------------------------------------------------------------
# The Triton kernel's op (docs/cuda.md, "The Triton kernel"): the schema of attnkit::fused_attention under its own
# name, defined here in Python (it needs no compiled extension). Its CUDA kernel is the Triton kernel; on CPU
# tensors it runs only under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests run its real code.
_TRITON_OP = "attnkit::fused_attention_triton"
_TRITON_DTYPES = (torch.float16, torch.bfloat16)
_LIB = torch.library.Library("attnkit", "FRAGMENT")
_LIB.define(
    "fused_attention_triton(Tensor q, Tensor k, Tensor v, Tensor lengths, Tensor? token_class, "
    "Tensor? sentence_id, float scaling, int num_windows, Tensor? mode, Tensor? region, bool renormalize, "
    "Tensor? gates, bool want_features, Tensor? key_scale=None, Tensor? kv_head=None, bool causal=False, "
    "int? sliding_window=None, float? softcap=None, Tensor? sink=None, Tensor? key_lengths=None, "
    "Tensor? key_class=None, Tensor? bias=None, bool symmetric_window=False, Tensor? grid=None, "
    "bool alignment=False) "
    "-> (Tensor, Tensor)")


def _fused_attention_triton(q, k, v, lengths, *args):
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise AttnkitError("the Triton kernel runs on CUDA tensors (on CPU tensors only under TRITON_INTERPRET=1)")
    try:  # imported on first use: importing triton costs seconds
        from .kernels import triton_attention
    except ImportError as exc:
        raise AttnkitError(f"ATTNKIT_CUDA_KERNEL=triton needs the triton package ({exc}); install attnkit's "
                           "'gpu-triton' extra") from None
    return triton_attention.fused_attention(q, k, v, lengths, *args)


_LIB.impl("fused_attention_triton", _fused_attention_triton, "CUDA")
_LIB.impl("fused_attention_triton", _fused_attention_triton, "CPU")


def _fused_attention_fake(q, k, v, lengths, *args, **params):
    p = AttentionParams(*args, **params)
    B, H, Lq, D = q.shape  # Lq <= the keys' length: a KV-cache step has one row per new token
    out = q.new_empty((B, Lq, H, D))
    nf = (num_features(p.num_windows, sink=p.sink is not None, grid=p.grid is not None, alignment=bool(p.alignment))
          if p.want_features else 0)
    feats = q.new_empty((B, H, nf), dtype=torch.float32)
    return out, feats


torch.library.register_fake(_TRITON_OP)(_fused_attention_fake)

# positions of the op's inputs that get gradients besides q, k and v (csrc/ops.cpp)
_GATES, _SINK, _BIAS = (AttentionParams.position(name) for name in ("gates", "sink", "bias"))
_N_PARAMS = len(dataclasses.fields(AttentionParams))


def _setup_context(ctx, inputs, output):
    q, k, v, lengths = inputs[:4]
    # the decoder arguments come last, absent from older builds (their defaults); the lse op (3 or 4 outputs) takes
    # those before key_lengths, then symmetric_window, want_max_logit, grid and alignment (the dispatcher fills in
    # defaults)
    if len(output) >= 3:
        tail = inputs[4 + _LSE_PARAMS:]
        p = AttentionParams(*inputs[4:4 + _LSE_PARAMS], symmetric_window=bool(tail[0]) if tail else False,
                            grid=tail[2] if len(tail) > 2 else None,
                            alignment=bool(tail[3]) if len(tail) > 3 else False)
    else:
        p = AttentionParams(*inputs[4:4 + _N_PARAMS])
    # _LSE_OP's outputs (out, features, lse[, max_logit]): its backward reuses out and lse instead of recomputing them
    saved = (output[0], output[2]) if len(output) >= 3 else ()
    ctx.save_for_backward(q, k, v, lengths, *p.tensors(), *saved)
    ctx.params = p.with_tensors((None,) * len(p.tensors()))  # the tensors are saved above
    ctx.n_inputs = len(inputs)
    # backward differentiates the attention output only: the features (and the lse) get no grad_fn
    ctx.mark_non_differentiable(*output[1:])


def _saved(ctx) -> tuple:
    """(q, k, v, lengths, the op's AttentionParams, the saved (out, lse) or ()), unpacked once: gradient
    checkpointing allows one unpack per backward."""
    tensors = ctx.saved_tensors
    n = 4 + len(ctx.params.tensors())
    return (*tensors[:4], ctx.params.with_tensors(tensors[4:n]), tuple(tensors[n:]))


def _backward(ctx, grad_out, grad_feats, *_grad_lse_and_max_logit):
    """The gradients of the op's output (docs/training.md, "The backward"): without an intervention (mode, region,
    renormalize) by attnkit.kernels.backward, which never builds an L×L map; with one, or with fewer queries than
    keys (a KV-cache step), by re-running the differentiable reference (L×L maps). After `_LSE_OP` without gates
    the saved output and log-sum-exp go to the backward (with gates the saved output is gated: recomputed)."""
    q, k, v, lengths, p, saved = _saved(ctx)
    needs = ctx.needs_input_grad
    result = [None] * ctx.n_inputs
    if (p.mode is None and p.region is None and not p.renormalize and q.shape[2] == k.shape[2] and not p.cross
            and p.bias is None):
        from .kernels.backward import attention_backward

        saved = saved if p.gates is None and len(saved) == 2 else None
        dq, dk, dv, dg, ds = attention_backward(grad_out, q, k, v, lengths, scaling=p.scaling, gates=p.gates,
                                                saved=saved, **p.decoder())
        for i, g in ((0, dq), (1, dk), (2, dv), (_GATES, dg), (_SINK, ds)):
            if i < len(needs) and needs[i]:
                result[i] = g
        return tuple(result)
    return tuple(_reference_backward(ctx, q, k, v, lengths, p, grad_out, result))


def _reference_backward(ctx, q, k, v, lengths, p: AttentionParams, grad_out, result: list) -> list:
    """The gradients under an intervention: autograd through the reference, which materialises the L×L weights."""
    needs = ctx.needs_input_grad
    leaves = {}
    with torch.enable_grad():
        qd, kd, vd = (t.detach().requires_grad_(needs[i]) for i, t in enumerate((q, k, v)))
        gd = None if p.gates is None else p.gates.detach().requires_grad_(needs[_GATES])
        sd = None if p.sink is None else p.sink.detach().requires_grad_(needs[_SINK])
        bd = None if p.bias is None else p.bias.detach().requires_grad_(_BIAS < len(needs) and needs[_BIAS])
        # the output only: no features (as the op's backward differentiates the output only)
        out, _ = params_attention(qd, kd, vd, lengths, dataclasses.replace(p, gates=gd, sink=sd, bias=bd,
                                                                           want_features=False, key_scale=None))
        for i, t in ((0, qd), (1, kd), (2, vd), (_GATES, gd), (_SINK, sd), (_BIAS, bd)):
            if t is not None and i < len(needs) and needs[i]:
                leaves[i] = t
        grads = torch.autograd.grad(out, list(leaves.values()), grad_out, allow_unused=True)
    for i, g in zip(leaves, grads):
        result[i] = g
    return result


torch.library.register_autograd(_TRITON_OP, _backward, setup_context=_setup_context)

if extension_loaded():
    torch.library.register_fake(_OP)(_fused_attention_fake)

    @torch.library.register_fake(_JS_OP)
    def _js_distances_fake(attn, lengths):
        M = attn.shape[1]
        return attn.new_empty((M, M), dtype=torch.float64)

    torch.library.register_autograd(_OP, _backward, setup_context=_setup_context)

    if has_kernel("cpu", _LSE_OP):  # an extension built before the op has no such schema
        @torch.library.register_fake(_LSE_OP)
        def _fused_attention_lse_fake(q, k, v, lengths, *args, symmetric_window=False, want_max_logit=False,
                                      grid=None, alignment=False):
            n = _LSE_PARAMS  # the arguments before key_lengths; then symmetric_window, want_max_logit, grid, alignment
            if len(args) > n + 1:  # given by position (symmetric_window does not change a shape)
                want_max_logit = args[n + 1]
            if len(args) > n + 2:
                grid = args[n + 2]
            if len(args) > n + 3:
                alignment = args[n + 3]
            out, feats = _fused_attention_fake(q, k, v, lengths, *args[:n], grid=grid, alignment=bool(alignment))
            B, H, L, _ = q.shape
            lse = q.new_empty((B, H, L), dtype=torch.float32)
            if not _LSE_MAX_LOGIT:  # an extension built before the max logit: three outputs
                return out, feats, lse
            return out, feats, lse, q.new_empty((B, H if want_max_logit else 0), dtype=torch.float32)

        torch.library.register_autograd(_LSE_OP, _backward, setup_context=_setup_context)
