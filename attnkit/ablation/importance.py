"""Gradient head importance and iterative pruning (Michel et al. 2019, "Are Sixteen Heads Really Better
than One?").

Every head's output is multiplied by a gate ξ_h (1 = unchanged). The importance of head h is
    I_h = mean over examples x of |∂L(x) / ∂ξ_h|
taken at ξ = 1 under the current pruning mask (pruned heads have mode zero, hence I_h = 0). As in the
paper (following Molchanov et al. 2017) the scores are normalised per layer by their ℓ2 norm unless
`normalize_layers=False`. The gates reach attnkit.ops.attention through `Intervention.gates`; autograd
flows to them through the reference attention (the fused op's backward re-runs the reference).

Iterative pruning: starting from the unpruned model, repeatedly recompute importance under the current
mask and zero the least important still-active heads until 10%, 20%, ... of all heads are pruned,
evaluating the task metric at each step. On a model already pruned physically (attnkit/arch/pruning.py) "all
heads" are the heads it still has: a removed head is never a step of the curve. `among` restricts the pruning to
some heads (Michel et al.'s Enc-Enc, Dec-Dec and Enc-Dec curves of an encoder–decoder, each pruning one kind); the
shares are then of those heads.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..arch.pruning import pruned_head_grid
from ..errors import AttnkitError
from ..features import KEEP, MODES
from ..interventions import Intervention, only


def head_importance(model, losses: Callable[[], Iterable[torch.Tensor]], base: Intervention | None = None, *,
                    normalize_layers: bool = True) -> dict:
    """|∂L/∂gate| per head, accumulated over the losses `losses()` yields (one per example or group).

    `base`: the intervention in force (e.g. the heads pruned so far); default: keep every head.
    Returns {"raw": n_layers × n_heads mean |grad|, "importance": the normalised scores, "n": count}.
    """
    base = base or Intervention.for_model(model)
    iv = base.with_gates()
    total = torch.zeros(iv.shape, dtype=torch.float64)
    n = 0
    params = [p for p in model.parameters()]
    saved = [p.requires_grad for p in params]
    for p in params:  # only the gates need gradients
        p.requires_grad_(False)
    try:
        with torch.enable_grad(), only(model, iv):
            for loss in losses():
                if not loss.requires_grad:
                    raise AttnkitError("the task loss does not depend on the head gates (is the model instrumented?)")
                (grad,) = torch.autograd.grad(loss, iv.gates)
                total += grad.detach().abs().double().cpu()
                n += 1
    finally:
        for p, s in zip(params, saved):
            p.requires_grad_(s)
    if n == 0:
        raise AttnkitError("no examples to compute head importance on")
    raw = (total / n).numpy()
    return {"raw": raw, "importance": normalize_by_layer(raw) if normalize_layers else raw.copy(), "n": n}


def normalize_by_layer(scores: np.ndarray) -> np.ndarray:
    """Divide each layer's scores by their ℓ2 norm (a layer of zeros stays zero)."""
    norm = np.linalg.norm(scores, axis=1, keepdims=True)
    return np.where(norm > 0, scores / np.where(norm > 0, norm, 1.0), 0.0)


def kept_head_grid(model, shape: tuple[int, int]) -> np.ndarray:
    """layers × heads booleans of attnkit's numbering, True where the model still has the head (an encoder–decoder's
    encoder, decoder and cross layers: docs/seq2seq.md)."""
    grid = pruned_head_grid(model)
    if grid.shape != tuple(shape):
        raise AttnkitError(f"the model's pruned heads ({grid.shape[0]} layers × {grid.shape[1]} heads) do not match "
                           f"attnkit's {shape[0]} × {shape[1]}")
    return grid


def pruning_schedule(n_heads: int, step: float = 0.1, max_share: float = 1.0) -> list[int]:
    """Cumulative numbers of pruned heads at shares 0, step, 2·step, ... ≤ max_share."""
    if not 0 < step <= 1:
        raise AttnkitError(f"pruning step must be in (0, 1], got {step}")
    k = int(np.floor(max_share / step + 1e-9))
    return sorted(set(int(round(i * step * n_heads)) for i in range(k + 1)))


def iterative_pruning(model, evaluate: Callable[[Intervention], dict], losses: Callable[[], Iterable[torch.Tensor]],
                      *, mode: str = "zero", step: float = 0.1, max_share: float = 1.0,
                      normalize_layers: bool = True, progress: bool = False, among: np.ndarray | None = None) -> dict:
    """Prune heads by increasing importance (recomputed after each step) and evaluate at each share.

    `among`: a layers × heads boolean array, True for the heads that may be pruned (default: every head).
    Returns {"steps": [{"pruned": k, "share": k/N, "metrics": {...}, "heads": [(l, h), ...]}],
             "importance": the first (unpruned) importance dict}, N the number of heads that may be pruned.
    """
    if mode not in MODES or mode == "keep":
        raise AttnkitError(f"pruning mode must be zero or uniform, got {mode!r}")
    iv = Intervention.for_model(model)
    has = kept_head_grid(model, iv.shape)  # False: a head an earlier pruning removed from the model
    if among is not None:
        among = np.asarray(among)
        if among.dtype != bool or among.shape != iv.shape:
            raise AttnkitError(f"`among` must be a {iv.shape[0]} × {iv.shape[1]} boolean array (layers × heads), got "
                               f"{among.dtype} of shape {among.shape}")
        has = has & among
    n_total = int(has.sum())
    if n_total == 0:
        raise AttnkitError("no head to prune: `among` selects none of the model's heads")
    schedule = pruning_schedule(n_total, step, max_share)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(schedule), desc="prune", unit="step", dynamic_ncols=True)
    steps, first = [], None
    pruned: list[tuple[int, int]] = []
    current = None  # importance under the current mask
    for k in schedule:
        if current is None and (first is None or k > len(pruned)):
            current = head_importance(model, losses, iv, normalize_layers=normalize_layers)
            first = first or current
        if k > len(pruned):
            scores = np.where((iv.mode == KEEP) & has, current["importance"], np.inf)
            order = np.argsort(scores, axis=None, kind="stable")
            for flat in order[: k - len(pruned)]:
                lh = tuple(int(x) for x in np.unravel_index(flat, iv.shape))
                iv.set(*lh, mode=mode)
                pruned.append(lh)
            current = None
        steps.append({"pruned": k, "share": k / n_total, "metrics": evaluate(iv.copy()), "heads": list(pruned)})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {"steps": steps, "importance": first}
