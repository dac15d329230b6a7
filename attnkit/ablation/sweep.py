"""Evaluating many settings of one task together (docs/interventions.md, "Sweeps").

A plain loop evaluates each setting on the whole data set: every setting runs every layer of every batch. But a
setting that first changes layer l leaves layers 0 … l − 1 as they are. Here the loop is over batches, and per batch:

1. one forward without any intervention keeps what each layer hands to the next (attnkit.caching.layers); the
   settings that change nothing take their outputs from it;
2. the settings that start at layer l run from layer l on, their layers 0 … l − 1 replaced by the kept hidden
   states: each costs the layers it changes and those after, not the whole model;
3. where memory allows, settings that start at the same layer run as one forward: the batch repeated once per
   setting, each block of samples under its own intervention (`StackedInterventions`).

The numbers equal the plain loop's: the layers that run get exactly the inputs they get in a full forward, and a
sample's result does not depend on the other samples of its forward (checked in tests/test_sweeps.py; on this
machine's BLAS they are bit for bit the same, see bench/sweep.py).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import numpy as np
import torch

from ..caching import capturing_layer_outputs, encoder_layers, starting_at
from ..errors import AttnkitError, check_int
from ..interventions import Intervention, StackedInterventions, only
from ..models import instrument
from ..tokens import Batch

STACK_BYTES = 1 << 30  # memory that the settings run as one forward may take (estimated), when `stack` is not given
PARTS_BYTES = 2 << 30  # memory for the reduced outputs kept until the end of a pass over the data


def repeat_batch(batch: Batch, times: int) -> Batch:
    """`batch` with every sample repeated: `times` copies, one after the other."""
    def rep(t):
        return repeat_outputs(t, times)

    return Batch({k: rep(v) for k, v in batch.inputs.items()}, rep(batch.lengths), rep(batch.token_class),
                 rep(batch.sentence_id), batch.n_truncated)


def repeat_outputs(obj, times: int):
    """A layer's output (a tensor, or a tuple of them) repeated `times` along the batch, as `repeat_batch`."""
    if isinstance(obj, torch.Tensor):
        return obj.repeat(times, *([1] * (obj.dim() - 1)))
    if isinstance(obj, tuple):
        return tuple(repeat_outputs(o, times) for o in obj)
    return obj


def block(outputs, i: int, size: int):
    """Samples i·size … (i + 1)·size − 1 of a task's outputs (a tensor or a tuple of tensors)."""
    if isinstance(outputs, tuple):
        return tuple(block(o, i, size) for o in outputs)
    return outputs[i * size:(i + 1) * size]


def nbytes(obj) -> int:
    """Bytes of the tensors and arrays in `obj` (nested lists, tuples and dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(nbytes(o) for o in obj.values())
    return 64


class Sweep:
    """Evaluate a task under many interventions in one pass over its batches (see the module docstring).

    `stack`: settings run as one forward (None: as many as `stack_bytes` allows, estimated from the model's hidden
    size and the task's outputs; 1: one forward per setting)."""

    def __init__(self, task, model, tokenizer, *, limit=None, batch_size: int = 32, stack: int | None = None,
                 stack_bytes: int = STACK_BYTES, parts_bytes: int = PARTS_BYTES):
        self.task, self.model, self.tokenizer = task, model, tokenizer
        self.limit, self.batch_size = limit, check_int(batch_size, "batch_size")
        self.stack = None if stack is None else check_int(stack, "stack")
        self.stack_bytes, self.parts_bytes = stack_bytes, parts_bytes

    def _stack_size(self, batch: Batch, outputs) -> int:
        if self.stack is not None:
            return self.stack
        B, L = batch.token_class.shape  # (an image's batch has pixel_values, no input_ids)
        hidden = getattr(self.model.config, "hidden_size", 768)
        per_copy = B * L * hidden * 4 * 16 + nbytes(outputs)  # ~16 hidden-sized activations alive per token
        return max(1, int(self.stack_bytes // max(per_copy, 1)))

    def run(self, interventions: list[Intervention], progress: bool = False, desc: str = "sweep") -> list[tuple]:
        """(metrics, per-example outputs) of the task under each intervention, in the order given."""
        instrument(self.model)
        n_layers = len(encoder_layers(self.model))
        for iv in interventions:
            if not isinstance(iv, Intervention):
                raise AttnkitError(f"a sweep evaluates attnkit.Intervention settings, got {type(iv).__name__}")
            if iv.gates is not None:
                raise AttnkitError("a sweep evaluates settings without gates (gates need gradients, one by one)")
        plan = self.task.plan(self.model, self.tokenizer, self.limit, self.batch_size)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            # one step: one batch of one setting ("setting·batch/s" read badly); the label says how many of each
            bar = tqdm(total=len(plan.steps) * len(interventions), unit="batch", dynamic_ncols=True,
                       desc=f"{desc}: {len(interventions)} settings × {len(plan.steps)} batches")
        # settings in the order of the layer they start at; rounds of them that fit `parts_bytes`
        order = sorted(range(len(interventions)), key=lambda i: interventions[i].first_changed_layer())
        results: list = [None] * len(interventions)
        try:
            start = 0
            while start < len(order):
                chosen, parts = self._round(plan, [interventions[i] for i in order[start:]], n_layers, bar)
                for j, part in zip(order[start:start + chosen], parts):
                    m = self.task.summarize(plan, part)
                    results[j] = (m, self.task.last_examples)
                start += chosen
        finally:
            if bar is not None:
                bar.close()
        return results

    def _round(self, plan, ivs: list, n_layers: int, bar) -> tuple[int, list]:
        """Run as many of `ivs` (sorted by first changed layer) over every step as their reduced outputs allow;
        returns (how many, their parts per step)."""
        chosen = len(ivs)
        parts: list = [[] for _ in ivs]
        for k, step in enumerate(plan.steps):
            B = len(step.batch.lengths)
            starts = [iv.first_changed_layer() for iv in ivs[:chosen]]
            keep = {s - 1 for s in starts if 0 < s < n_layers}
            with torch.inference_mode():
                self.task.prepare(self.model, step)
                with only(self.model, None), capturing_layer_outputs(self.model, keep) as kept:
                    plain = self.task.outputs(self.model, step.batch)
                reduced = self.task.reduce(step, plain)
                if k == 0:  # how many settings' reduced outputs fit in memory until the end of the pass
                    per_setting = nbytes(reduced) * len(plan.steps)
                    chosen = max(1, min(chosen, int(self.parts_bytes // max(per_setting, 1))))
                    parts, starts = parts[:chosen], starts[:chosen]
                G = self._stack_size(step.batch, plain)
                by_layer = defaultdict(list)
                for i, s in enumerate(starts):
                    if s >= n_layers:
                        parts[i].append(reduced)  # changes nothing: the plain forward's outputs
                        if bar is not None:
                            bar.update(1)
                    else:
                        by_layer[s].append(i)
                for s in sorted(by_layer):
                    members = by_layer[s]
                    for p in range(0, len(members), G):
                        pack = members[p:p + G]
                        self._run_pack(step, B, s, kept.get(s - 1), [ivs[i] for i in pack],
                                       [parts[i] for i in pack])
                        if bar is not None:
                            bar.update(len(pack))
                del plain, kept
        return chosen, parts

    def _run_pack(self, step, B: int, layer: int, hidden, ivs: list, into: list) -> None:
        """The settings `ivs`, which all start at `layer`, as one forward; each one's reduced outputs of the step go
        to its list in `into`."""
        n = len(ivs)
        batch = step.batch if n == 1 else repeat_batch(step.batch, n)
        with contextlib.ExitStack() as stack:
            if layer > 0:
                stack.enter_context(starting_at(self.model, layer, repeat_outputs(hidden, n)))
            stack.enter_context(only(self.model, ivs[0] if n == 1 else StackedInterventions(ivs, B)))
            outputs = self.task.outputs(self.model, batch)
        for i in range(n):
            into[i].append(self.task.reduce(step, block(outputs, i, B) if n > 1 else outputs))


__all__ = ["Sweep", "block", "repeat_batch", "repeat_outputs"]
