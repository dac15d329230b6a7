"""The mean output of every head over a corpus, for mean ablation (docs/interventions.md, "Patch and mean").

    means = attnkit.head_means(texts, (model, tokenizer), checkpoint="means.npz")
    iv.set(2, 5, mode="mean", value=means.mean[2, 5])

A head's mean is the average of its per-token output (what it hands to the output projection, before that
projection) over every valid token of the corpus: each token weighs the same. It runs on the extraction engine:
the corpus is streamed and planned in length-sorted windows (docs/pipeline.md), tokenised by `workers` processes
ahead of the model, and with `checkpoint` the sums are saved as it goes (attnkit/run/head_means.py), so an
interrupted run continues where it stopped and a finished one is read back instead of computed again.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..caching import cache_heads
from ..engine.extract import check_texts
from ..engine.forward import default_batch_size
from ..engine.local import BatchResult, check_workers, run_pipeline
from ..engine.plan import DEFAULT_WINDOW, plan_batches
from ..engine.progress import segment_bar
from ..errors import AttnkitError, check_int
from ..features import DEFAULT_MAX_LENGTH
from ..models import attention_modules, resolve_model, runtime_of
from ..run.head_means import HeadMeans
from ..tokens import Encoder

CHECKPOINT_SECONDS = 60.0  # a checkpoint is saved at least this often, and when the run stops


def head_sums(model, batch) -> torch.Tensor:
    """n_layers × n_heads × head size (float64): every head's outputs summed over the valid tokens of `batch` (an
    `attnkit.tokens.Batch` on the model's device)."""
    n_layers = len(attention_modules(model))
    with cache_heads(model) as cache, runtime_of(model).batch_of(batch), torch.inference_mode():
        model(**batch.inputs)
    L = batch.inputs["input_ids"].shape[1]
    valid = (torch.arange(L, device=batch.lengths.device)[None, :] < batch.lengths[:, None]).double()
    return torch.stack([torch.einsum("bl,blhd->hd", valid, cache[layer].double()) for layer in range(n_layers)])


def _fingerprint(texts) -> str:
    from ..corpus import Corpus

    if isinstance(texts, Corpus):
        return texts.fingerprint()
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode()).hexdigest()


def weights_fingerprint(model) -> str:
    """SHA-256 of every parameter and buffer of `model` (names and bytes): head means made by other weights under
    the same model path are not continued."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def head_means(texts, model=None, *, tokenizer=None, max_length: int = DEFAULT_MAX_LENGTH,
               batch_size: int | None = None, window: int = DEFAULT_WINDOW, device=None, dtype=None, workers: int = 0,
               checkpoint=None, fresh: bool = False, progress: bool = False,
               on_batch: Callable[[HeadMeans, BatchResult], None] | None = None) -> HeadMeans:
    """The mean output of every head of `model` over `texts` (a list of str or (str, str) pairs, or an
    attnkit.corpus.Corpus, which is streamed). `model`: None (the embedded MiniLM), a local path, or a
    (model, tokenizer) pair. `workers`: tokenisation processes ahead of the model. `checkpoint`: an .npz path that
    keeps the sums as they grow; an existing one made under the same settings is continued (or, finished, read
    back), one made under others is refused; with `fresh` an existing one is neither read nor removed, only
    replaced by this call's first save. `on_batch(state, result)` runs after every batch.
    Returns a `HeadMeans` (`.mean`: n_layers × n_heads × head size)."""
    from ..corpus import Corpus

    if not isinstance(texts, Corpus):
        texts = check_texts(texts)
    check_workers(workers)
    model, tokenizer = resolve_model(model, tokenizer, device, dtype, max_length=max_length,
                                     function="attnkit.head_means")
    dev = next(model.parameters()).device
    batch_size = default_batch_size(dev) if batch_size is None else check_int(batch_size, "batch_size")
    n_layers, n_heads = len(attention_modules(model)), model.config.num_attention_heads
    head_size = getattr(model.config, "hidden_size", 0) // n_heads
    settings = {"model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
                "shape": [n_layers, n_heads, head_size], "max_length": max_length, "batch_size": batch_size,
                "window": window, "texts_sha256": _fingerprint(texts), "weights_sha256": weights_fingerprint(model),
                "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    state = HeadMeans(np.zeros((n_layers, n_heads, head_size)), settings=settings)
    if checkpoint is not None and not fresh and Path(checkpoint).exists():
        saved = HeadMeans.load(checkpoint)
        if saved.settings != settings:
            diff = sorted(k for k in set(settings) | set(saved.settings) if settings.get(k) != saved.settings.get(k))
            raise AttnkitError(f"{checkpoint} holds head means made with other settings ({', '.join(diff)} differ): "
                               "give another checkpoint path or remove it")
        if saved.complete:
            return saved
        state = saved
    bar = None
    if progress:
        bar = segment_bar("head means", texts, initial=state.next_index)
    last_save = [time.monotonic()]

    def deliver(res: BatchResult) -> None:
        if res.features.shape != state.sums.shape:
            raise AttnkitError(f"the model's head outputs have shape {res.features.shape[1:]}, expected "
                               f"{state.sums.shape[1:]} per layer")
        state.add(res.features, res.n_tokens, res.planned.end)
        if bar is not None:
            bar.update(len(res.planned.segments))
        if checkpoint is not None and time.monotonic() - last_save[0] > CHECKPOINT_SECONDS:
            state.save(checkpoint)
            last_save[0] = time.monotonic()
        if on_batch is not None:
            on_batch(state, res)

    encoder = Encoder(tokenizer, max_length=max_length)
    planned = plan_batches(texts, batch_size, window, skip_segments=state.next_index)
    try:
        run_pipeline([model], encoder, planned, head_sums, workers=workers, on_result=deliver)
        if bar is not None:
            bar.finish()
    except BaseException:
        if checkpoint is not None:
            state.save(checkpoint)  # what was measured is kept: the same call continues from here
        raise
    finally:
        if bar is not None:
            bar.close()
    if state.n_tokens == 0:
        raise AttnkitError("no tokens to average over: the texts are empty")
    state.complete = True
    if checkpoint is not None:
        state.save(checkpoint)
    return state


__all__ = ["head_means", "head_sums"]
