"""The attention maps of one text: `attnkit.attention_maps(text, model)` (docs/analysis.md, "Maps of one text").

It is a plain forward of the instrumented model with `output_attentions=True` (attnkit/hf_attention.py returns
every layer's maps then, equal to eager attention's), under an intervention when one is given: the maps are
the weights the model really used.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..corpus.sources import is_blank
from ..errors import AttnkitError, arg
from ..features import DEFAULT_MAX_LENGTH
from ..interventions import Intervention, intervene
from ..models import resolve_model
from ..tokens import Encoder, shown_token, to_str_tokens


@dataclass
class AttentionMaps:
    """Every head's attention map of one text.

    `weights`: float32 array layers × heads × n × n (`weights[l, h, s, t]`: the weight query token `s` gives key
    token `t` in head `h` of layer `l`; rows sum to 1 unless an intervention changed them); `tokens`: the n
    tokens as readable text (`attnkit.to_str_tokens`: byte-level BPE's 'Ġis' is ' is', 'Ċ' a newline), special tokens
    included, shown with ↵ for a newline in `repr` and `to_pandas`; `text`: the text (a str or a (str, str) pair).
    """

    text: object
    tokens: list[str]
    weights: np.ndarray

    @property
    def n_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def n_heads(self) -> int:
        return self.weights.shape[1]

    def head(self, layer: int, head: int) -> np.ndarray:
        """The n × n map of one head."""
        if not (0 <= layer < self.n_layers and 0 <= head < self.n_heads):
            raise AttnkitError(f"head L{layer}H{head} is outside this model's {self.n_layers} layers × "
                               f"{self.n_heads} heads")
        return self.weights[layer, head]

    def to_pandas(self, layer: int, head: int):
        """One head's map as a DataFrame: rows are query tokens, columns key tokens (positions are prefixed, as
        tokens repeat)."""
        import pandas as pd

        labels = [f"{i}:{shown_token(t)}" for i, t in enumerate(self.tokens)]
        return pd.DataFrame(self.head(layer, head), index=labels, columns=labels)

    def __repr__(self) -> str:
        shown = " ".join(shown_token(t) for t in self.tokens[:12]) + (" …" if len(self.tokens) > 12 else "")
        return f"AttentionMaps({self.n_layers} layers × {self.n_heads} heads, {len(self.tokens)} tokens: {shown})"


def _check_text(text):
    if isinstance(text, str):
        segment = text
    elif isinstance(text, (tuple, list)) and len(text) == 2 and all(isinstance(x, str) for x in text):
        segment = tuple(text)
    else:
        raise AttnkitError(f"{arg('text')} must be a string or a pair of strings (one text; call attention_maps "
                           f"once per text), got {type(text).__name__}")
    if is_blank(segment):
        raise AttnkitError(f"{arg('text')} is empty (blank): there is nothing of it to map")
    return segment


def attention_maps(text, model=None, *, tokenizer=None, max_length: int = DEFAULT_MAX_LENGTH, device=None,
                   intervention: Intervention | None = None) -> AttentionMaps:
    """The attention maps of every head of `model` on one `text` (a str, or a (str, str) pair).

    `model`: None for the embedded MiniLM, a local path, or a (model, tokenizer) pair (as in `attnkit.extract`).
    The text is tokenised as `attnkit extract` does, by the same `attnkit.tokens.Encoder` (special tokens added,
    cut to `max_length` tokens, a pair refused when `max_length` cannot hold a token of each side).
    `intervention`: the maps under that `attnkit.Intervention` (what the model used, e.g. uniform rows for a
    head in mode uniform).
    """
    segment = _check_text(text)
    model, tokenizer = resolve_model(model, tokenizer, device, max_length=max_length,
                                     function="attnkit.attention_maps")
    dev = next(model.parameters()).device
    enc = {k: v.to(dev) for k, v in Encoder(tokenizer, max_length=max_length)([segment]).inputs.items()}
    with torch.inference_mode():
        if intervention is not None:
            with intervene(model, intervention):
                out = model(**enc, output_attentions=True)
        else:
            out = model(**enc, output_attentions=True)
    maps = getattr(out, "attentions", None)
    if not maps:
        raise AttnkitError(f"{type(model).__name__} returned no attention maps for output_attentions=True")
    weights = torch.stack([m[0] for m in maps]).float().cpu().numpy()
    tokens = to_str_tokens(tokenizer, enc["input_ids"][0].tolist())
    return AttentionMaps(text if isinstance(text, str) else tuple(text), tokens, weights)


def cls_attention_over_patches(item, model, processor) -> tuple[np.ndarray, np.ndarray]:
    """For one image (`item`, an attnkit.corpus.images.ImageItem) under an instrumented vision transformer and its
    image processor: (layers × heads × rows × columns, the attention of [CLS] to each patch; the image as the model
    saw it, H × W × 3 uint8, its pixel_values scaled back to 0..255). Processed as `attnkit extract --images` does
    (attnkit.tokens.ImageEncoder)."""
    from ..attention.positions import ImageTokens
    from ..models import runtime_of
    from ..tokens import ImageEncoder, image_forward_arguments

    layout = runtime_of(model).image
    arrays = ImageEncoder(processor, layout).encode_arrays([item])
    dev = next(model.parameters()).device
    inputs = {k: torch.from_numpy(v).to(dev) for k, v in arrays.inputs.items()}
    with torch.inference_mode():
        out = model(**inputs, output_attentions=True, **image_forward_arguments(model, inputs))
    rows, cols = ImageTokens(layout, tuple(inputs["pixel_values"].shape[-2:])).shape
    first = len(layout.prefix)
    if not first:
        raise AttnkitError(f"a {layout.model_type} model has no [CLS] token: there is no [CLS] attention to map")
    maps = torch.stack([a[0, :, 0, first:] for a in out.attentions]).float().cpu().numpy()
    px = arrays.inputs["pixel_values"][0].transpose(1, 2, 0)
    lo, hi = float(px.min()), float(px.max())
    image = ((px - lo) / (hi - lo if hi > lo else 1.0) * 255).astype(np.uint8)
    return maps.reshape(maps.shape[0], maps.shape[1], rows, cols), image


__all__ = ["AttentionMaps", "attention_maps", "cls_attention_over_patches"]
