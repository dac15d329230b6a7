"""The real size of a (physically pruned) model: parameters, FLOPs and measured speed (docs/pruning.md).

* parameters: every parameter of the model (embeddings and task head included);
* FLOPs: of one plain forward of a reference batch, counted by torch's FlopCounterMode on eager attention (2 per
  multiply-add of the matrix products: the linear layers and the two attention products; element-wise work is
  not counted), divided by the batch's tokens;
* tokens/s: plain forwards of the reference batch (the model's own attention implementation, no measurement)
  timed with `time.perf_counter`, the median of `repeats`.

The reference batch is `batch_size` × `length` token ids drawn at random from the vocabulary (fixed seed), no
padding: speed and FLOPs depend on the shapes, not on the text. A vision transformer's is `batch_size` random images
of its config's size (its tokens: the patches and the tokens before them). `pruned_sizes` measures the models of a
pruning curve interleaved (every step once per round, `repeats` rounds), so a slow minute of the machine does not fall
on one step only; each step's model is a copy of the unpruned one with its heads removed, built anew each round,
so only one copy is in memory at a time.
"""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence

import torch

from ..arch.architectures import LAYOUTS
from ..arch.pruning import prune_heads, pruned_head_grid
from ..attention.positions import ImageTokens, image_layout
from ..models import max_positions

REFERENCE_BATCH = (16, 128)  # samples × tokens


def pruning_supported(model) -> bool:
    """Whether attnkit knows where `model`'s architecture keeps the projections that pruning shrinks."""
    layout = LAYOUTS.get(getattr(model.config, "model_type", None))
    return layout is not None and layout.prunable


def count_parameters(model) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def reference_inputs(model, batch_size: int = REFERENCE_BATCH[0], length: int = REFERENCE_BATCH[1],
                     seed: int = 0) -> dict:
    """`batch_size` × `length` random token ids of the model's vocabulary (at most its positions), no padding; an
    encoder–decoder reads the same ids as its source and its target (`decoder_input_ids`); a vision transformer
    `batch_size` random images of its config's size (`pixel_values`; `length` does not apply)."""
    layout = image_layout(model.config)
    if layout is not None:
        pixels = torch.rand(batch_size, layout.channels, *layout.image, generator=torch.Generator().manual_seed(seed))
        return {"pixel_values": pixels.to(next(model.parameters()).device)}
    limit = max_positions(model)
    length = length if limit is None else min(length, limit)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(model.config.vocab_size), (batch_size, length), generator=g)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), torch.ones_like(ids).to(device)
    if getattr(model.config, "is_encoder_decoder", False):
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids, "decoder_attention_mask": mask}
    return {"input_ids": ids, "attention_mask": mask}


def count_tokens(inputs: dict, model=None) -> int:
    """The tokens of a reference batch: an encoder–decoder's source and target tokens both; a vision transformer's
    (`model` given) its images' patches and the tokens before them."""
    if "pixel_values" in inputs:
        layout = image_layout(model.config)
        return int(inputs["pixel_values"].shape[0]) * ImageTokens(layout, layout.image).length
    return sum(int(inputs[k].numel()) for k in ("input_ids", "decoder_input_ids") if k in inputs)


def forward_flops(model, inputs: dict) -> int:
    """FLOPs of one plain forward of `inputs`, counted on eager attention (module docstring)."""
    from torch.utils.flop_counter import FlopCounterMode

    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            model(**inputs)
    finally:
        model.set_attn_implementation(impl)
    return int(counter.get_total_flops())


def time_forward(model, inputs: dict) -> float:
    """Seconds of one plain forward of `inputs` (after the device has finished)."""
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        model(**inputs)
        sync()
    return time.perf_counter() - t0


def pruned_sizes(model, head_sets: Sequence[Sequence[tuple[int, int]]], *, repeats: int = 3,
                 batch_size: int = REFERENCE_BATCH[0], length: int = REFERENCE_BATCH[1],
                 progress: bool = False) -> list[dict]:
    """For each set of heads, the model with those heads removed: {"params", "flops_per_token", "tokens_per_s"}
    (module docstring); `model` itself is not changed."""
    inputs = reference_inputs(model, batch_size, length)
    n_tokens = count_tokens(inputs, model)
    has = pruned_head_grid(model)  # a model pruned before: the heads it no longer has are already gone
    head_sets = [[(l, h) for l, h in heads if has[l, h]] for heads in head_sets]
    rows = [{} for _ in head_sets]
    times: list[list[float]] = [[] for _ in head_sets]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=repeats * len(head_sets), desc="sizes", unit="model", dynamic_ncols=True)
    for r in range(repeats):
        for i, heads in enumerate(head_sets):
            pruned = prune_heads(copy.deepcopy(model), heads)
            if r == 0:
                rows[i]["params"] = count_parameters(pruned)
                rows[i]["flops_per_token"] = forward_flops(pruned, inputs) / n_tokens
            time_forward(pruned, inputs)  # warm-up
            times[i].append(time_forward(pruned, inputs))
            del pruned
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    for row, t in zip(rows, times):
        row["tokens_per_s"] = n_tokens / statistics.median(t)
    return rows


__all__ = ["REFERENCE_BATCH", "count_parameters", "count_tokens", "forward_flops", "pruned_sizes", "pruning_supported",
           "reference_inputs", "time_forward"]
