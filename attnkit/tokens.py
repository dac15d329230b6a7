"""From text to batches: tokenisation, token classes and sentence ids (docs/features.md, "Token classes" and
"Sentence ids").

Class of a token: CLS (the tokenizer's cls/bos token), SEP (sep/eos), COMMA (token string exactly
","), PERIOD (exactly "."), else OTHER. Sentence ids: the segments of a text pair are different
sentences; with `split_sentences`, a segment is also split after "."/"!"/"?" tokens. A special token
belongs to the sentence before it, so [CLS] is in the first sentence and a [SEP] in the one it closes.

A decoder's tokenizer (docs/decoders.md, "Token classes"): one that names neither a cls nor a sep token (GPT-2,
Llama, Qwen, Mistral, Gemma, ...), or `causal=True`. There CLS is the sample's first position, whichever token it
holds (the BOS token where the tokenizer adds one: where a causal model puts its attention sink), SEP the EOS
tokens, and a BOS token elsewhere is OTHER. A decoder has no pair format, so text pairs are refused, not joined.
A tokenizer without a padding token pads with its EOS token (the attention mask marks the padding either way).

Images: `ImageEncoder` builds a vision transformer's batches from images (below, "images").
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .attention.positions import ImageLayout, ImageTokens, image_tokens
from .attention.runtime import RUNTIME_ATTR
from .corpus.images import ImageItem, decode_image
from .errors import AttnkitError, check_int
from .features import CLS, COMMA, DEFAULT_MAX_LENGTH, OTHER, PERIOD, SEP

Segment = str | tuple
SENTENCE_END = (".", "!", "?")
CHARS_PER_TOKEN = 64  # a text longer than max_length × this many characters is cut at a space before tokenising


@dataclass
class Batch:
    """A tokenised, right-padded batch plus what the attention op needs about its tokens."""

    inputs: dict  # input_ids, attention_mask (and token_type_ids) as the model takes them
    lengths: torch.Tensor  # int64 B
    token_class: torch.Tensor  # int32 B×L
    sentence_id: torch.Tensor  # int32 B×L
    n_truncated: int  # samples longer than max_length, cut to it
    # an encoder–decoder's batch (docs/seq2seq.md): the decoder's side (its lengths, token classes and sentence
    # ids; its ids and mask are `decoder_input_ids` and `decoder_attention_mask` in `inputs`); the fields above are
    # the source's
    target: Batch | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device, non_blocking: bool = False) -> Batch:
        def move(t):
            return t.to(device, non_blocking=non_blocking)

        return Batch({k: move(v) for k, v in self.inputs.items()}, move(self.lengths), move(self.token_class),
                     move(self.sentence_id), self.n_truncated,
                     None if self.target is None else self.target.to(device, non_blocking))

    def pin_memory(self) -> Batch:
        """Page-locked copies, so that `.to(cuda, non_blocking=True)` overlaps with the device's work."""
        return Batch({k: v.pin_memory() for k, v in self.inputs.items()}, self.lengths.pin_memory(),
                     self.token_class.pin_memory(), self.sentence_id.pin_memory(), self.n_truncated,
                     None if self.target is None else self.target.pin_memory())

    @classmethod
    def from_arrays(cls, arrays: EncodedArrays) -> Batch:
        """Wrap the numpy arrays of `Encoder.encode_arrays` without copying them (pairs: the target's ids and mask
        become the model's `decoder_input_ids` and `decoder_attention_mask`)."""
        inputs = {k: torch.from_numpy(v) for k, v in arrays.inputs.items()}
        target = None
        if arrays.target is not None:
            target = cls.from_arrays(arrays.target)
            inputs["decoder_input_ids"] = target.inputs.pop("input_ids")
            inputs["decoder_attention_mask"] = target.inputs.pop("attention_mask")
        return cls(inputs, torch.from_numpy(arrays.lengths), torch.from_numpy(arrays.token_class),
                   torch.from_numpy(arrays.sentence_id), arrays.n_truncated, target)


@dataclass
class EncodedArrays:
    """A batch as numpy arrays: what tokenisation workers send back (cheap to pickle, no torch needed)."""

    inputs: dict
    lengths: np.ndarray  # int64 B
    token_class: np.ndarray  # int32 B×L
    sentence_id: np.ndarray  # int32 B×L
    n_truncated: int
    full_lengths: np.ndarray | None = None  # int64 B: tokens before truncation
    # an encoder–decoder's pairs: the decoder's side (its `inputs` input_ids and attention_mask: the target shifted
    # right, `Encoder.encode_arrays`); the fields above are the source's
    target: EncodedArrays | None = None
    n_tokens: int = field(init=False)  # real tokens, counted once (the pipeline reads it several times a batch)

    def __post_init__(self):
        self.n_tokens = int(self.lengths.sum()) + (0 if self.target is None else self.target.n_tokens)

    def rows(self, index: np.ndarray) -> EncodedArrays:
        """The samples `index` (in that order) as a batch of their own, padded to the longest of them: the arrays
        `Encoder.encode_arrays` gives for those segments alone."""
        return self._batch_of(index)

    def span(self, start: int, stop: int) -> EncodedArrays:
        """`rows(range(start, stop))`, from slices (a planned unit sorted once runs its forwards as spans)."""
        return self._batch_of(slice(start, stop))

    def _batch_of(self, index) -> EncodedArrays:
        lengths = self.lengths[index]
        width = int(lengths.max()) if len(lengths) else 0

        def take(a: np.ndarray) -> np.ndarray:  # an image's pixel_values (B×C×H×W) have no token axis to cut
            return np.ascontiguousarray(a[index, :width] if a.ndim == 2 else a[index])

        full = None if self.full_lengths is None else self.full_lengths[index]
        target = None if self.target is None else self.target._batch_of(index)
        return EncodedArrays({k: take(v) for k, v in self.inputs.items()}, np.ascontiguousarray(lengths),
                             take(self.token_class), take(self.sentence_id),
                             int(cut_samples(full, lengths, target).sum()),
                             None if full is None else np.ascontiguousarray(full), target)


def cut_samples(full: np.ndarray | None, lengths: np.ndarray, target: EncodedArrays | None = None) -> np.ndarray:
    """Which samples truncation cut (a pair: on either side), from the lengths before and after it."""
    cut = np.zeros(len(lengths), dtype=bool) if full is None else full > lengths
    if target is not None:
        cut |= cut_samples(target.full_lengths, target.lengths)
    return cut


def _ids(tokenizer, *names) -> set[int]:
    out = set()
    for name in names:
        tid = getattr(tokenizer, f"{name}_token_id", None)
        if tid is not None:
            out.add(int(tid))
    return out


def _exact_token_id(tokenizer, token: str) -> int | None:
    """Id of a vocabulary entry whose string is exactly `token`, if there is one."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id and token != tokenizer.unk_token:
        return None
    return int(tid) if tokenizer.convert_ids_to_tokens(int(tid)) == token else None


def is_decoder_tokenizer(tokenizer) -> bool:
    """Whether `tokenizer` is a decoder language model's: it names neither a cls nor a sep token."""
    return getattr(tokenizer, "cls_token", None) is None and getattr(tokenizer, "sep_token", None) is None


def sentence_ids(ids: list[int], sequence_ids: list, end_ids=()) -> list[int]:
    """Sentence id per token of one sample. `sequence_ids`: the segment of each token (None for a
    special token, which belongs to the sentence before it); a new segment starts a new sentence, and
    so does the token after one of `end_ids` (sentence-final tokens, when splitting sentences)."""
    out = []
    sid, prev_seq, pending = 0, None, False
    for tok, seq in zip(ids, sequence_ids):
        if seq is None:  # special token: belongs to the sentence before it
            out.append(sid)
            continue
        if (prev_seq is not None and seq != prev_seq) or pending:
            sid += 1
        pending = tok in end_ids
        prev_seq = seq
        out.append(sid)
    return out


class Encoder:
    """Turns lists of segments (str or (str, str)) into `Batch`es for one tokenizer."""

    def __init__(self, tokenizer, max_length: int = DEFAULT_MAX_LENGTH, split_sentences: bool = False,
                 causal: bool | None = None, decoder_start: int | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise AttnkitError("attnkit needs a fast (Rust) tokenizer to locate segments")
        check_int(max_length, "max_length", minimum=2)
        self.tokenizer = tokenizer
        # an encoder–decoder's: the token its decoder starts with (`pair_decoder_start`); segments are then
        # (source, target) pairs (`encode_pairs`)
        self.decoder_start = decoder_start
        self.max_length = max_length
        self.split_sentences = split_sentences
        self.causal = is_decoder_tokenizer(tokenizer) if causal is None else bool(causal)
        if self.causal:  # CLS: the first position (token_classes); SEP: EOS tokens
            self.cls_ids = set()
            self.sep_ids = _ids(tokenizer, "eos")
        else:
            self.cls_ids = _ids(tokenizer, "cls", "bos")
            self.sep_ids = _ids(tokenizer, "sep", "eos")
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        self.comma_id = _exact_token_id(tokenizer, ",")
        self.period_id = _exact_token_id(tokenizer, ".")
        self.end_ids = {i for i in (_exact_token_id(tokenizer, t) for t in SENTENCE_END) if i is not None}

    def token_classes(self, ids: np.ndarray) -> np.ndarray:
        cls = np.full(ids.shape, OTHER, dtype=np.int32)
        for tid, code in ((self.comma_id, COMMA), (self.period_id, PERIOD)):
            if tid is not None:
                cls[ids == tid] = code
        cls[np.isin(ids, list(self.sep_ids))] = SEP
        cls[np.isin(ids, list(self.cls_ids))] = CLS
        if self.causal and cls.shape[-1]:  # right padding: every sample starts at position 0
            cls[..., 0] = CLS
        return cls

    def sentence_ids(self, ids: list[int], sequence_ids: list) -> list[int]:
        return sentence_ids(ids, sequence_ids, self.end_ids if self.split_sentences else ())

    def encode_arrays(self, segments: Sequence[Segment]) -> EncodedArrays:
        """Tokenise `segments` into numpy arrays (what worker processes run: no torch operations)."""
        if not segments:
            raise AttnkitError("cannot encode an empty batch")
        for s in segments:
            if not isinstance(s, (str, tuple, list)):
                what = f"images ({s.name})" if isinstance(s, ImageItem) else f"{type(s).__name__} {s!r:.60}"
                raise AttnkitError(f"this model takes text, not {what}: images need a vision transformer")
        if self.decoder_start is not None:
            return self.encode_pairs(segments)
        items = [self.bounded(s) if isinstance(s, str) else [self.bounded(x) for x in s] for s in segments]
        if self.causal and any(not isinstance(x, str) for x in items):
            raise AttnkitError("text pairs need a model with a pair format ([CLS] A [SEP] B [SEP]); this is a "
                               "decoder's tokenizer, which has none: give single texts (join the pair yourself if "
                               "that is what you mean)")
        self._check_room(items)
        enc = self.tokenizer(items, truncation=True, max_length=self.max_length, padding="longest",
                             return_tensors="np", padding_side="right")
        ids = np.ascontiguousarray(enc["input_ids"], dtype=np.int64)
        lengths = np.asarray(enc["attention_mask"], dtype=np.int64).sum(-1)
        if ids.shape[1] > self.max_length:
            raise AttnkitError(f"the tokenizer did not truncate to {self.max_length} tokens (got {ids.shape[1]})")
        # the Rust encodings keep what truncation cut off: only the truncated items are tokenised again, to
        # learn their full length (for the --max-length advice)
        cut = [i for i, e in enumerate(enc.encodings) if e.overflowing]
        n_truncated = len(cut)
        full_lengths = lengths.copy()
        if cut:
            again = self.tokenizer([items[i] for i in cut], truncation=False, verbose=False)["input_ids"]
            full_lengths[cut] = [len(x) for x in again]
        sentence = np.zeros(ids.shape, dtype=np.int32)
        for b in range(ids.shape[0]):
            n = int(lengths[b])
            sentence[b, :n] = self.sentence_ids(ids[b, :n].tolist(), enc.sequence_ids(b)[:n])
        inputs = {k: np.ascontiguousarray(v, dtype=np.int64) for k, v in enc.items()
                  if k in ("input_ids", "attention_mask", "token_type_ids")}
        return EncodedArrays(inputs, lengths, self.token_classes(ids), sentence, n_truncated, full_lengths)

    def bounded(self, text: str) -> str:
        """`text`, or, when it is far longer than `max_length` tokens can hold, its first words: those in its first
        max_length × CHARS_PER_TOKEN characters, cut at a space, when they alone make more than `max_length`
        tokens. Truncation then keeps the same tokens (of a single text and of each side of a pair: longest-first
        truncation cuts both sides of a pair whose sides are both over the limit to the same share), and a huge
        text (or pair) is never tokenised whole. Such a text counts as truncated; its full length is counted as
        that of the words kept (a lower bound)."""
        cap = self.max_length * CHARS_PER_TOKEN
        if len(text) <= cap:
            return text
        cut = max(text.rfind(c, 0, cap) for c in " \n\t")
        if cut <= 0:
            return text
        prefix = text[:cut]
        if len(self.tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"]) <= self.max_length:
            return text  # words too long to be sure: tokenise it whole
        return prefix

    def encode_pairs(self, segments: Sequence[Segment]) -> EncodedArrays:
        """An encoder–decoder's (source, target) pairs, teacher-forced (docs/seq2seq.md, "Extracting over pairs"):
        the sources tokenised as the model's inputs, the targets with the tokenizer's target side (`text_target=`),
        each cut to `max_length` tokens as single texts are. The decoder reads the target shifted right, as
        transformers' models do when given `labels`: `decoder_start` first, the target's last token dropped. The
        target's token classes are the source's rules with its first position CLS (the start token, the decoder's
        attention sink)."""
        for j, s in enumerate(segments):
            if isinstance(s, str) or len(s) != 2:
                raise AttnkitError(f"segment {j} of the batch is a single text, but this model is an "
                                   "encoder–decoder, which measures (source, target) pairs")
        self._check_room(["x"])
        source, _ = self._encode_side([self.bounded(s) for s, _ in segments], "text")
        target, sequences = self._encode_side([self.bounded(t) for _, t in segments], "text_target")
        ids, mask = target.inputs["input_ids"], target.inputs["attention_mask"]
        shifted = np.full_like(ids, self.tokenizer.pad_token_id)
        shifted[:, 0] = self.decoder_start
        shifted[:, 1:] = ids[:, :-1]
        shifted[mask == 0] = self.tokenizer.pad_token_id
        target.inputs["input_ids"] = shifted
        target.token_class = self.token_classes(shifted)
        if shifted.shape[1]:
            target.token_class[:, 0] = CLS
        sentence = np.zeros(shifted.shape, dtype=np.int32)
        for b, seq in enumerate(sequences):
            n = int(target.lengths[b])
            sentence[b, :n] = self.sentence_ids(shifted[b, :n].tolist(), [None] + seq[:n - 1])
        target.sentence_id = sentence
        return EncodedArrays(source.inputs, source.lengths, source.token_class, source.sentence_id,
                             int(cut_samples(source.full_lengths, source.lengths, target).sum()), source.full_lengths,
                             target)

    def _encode_side(self, texts: list[str], side: str) -> tuple[EncodedArrays, list]:
        """One side of a batch of pairs (`side`: the tokenizer's "text" or "text_target"), right-padded and cut to
        `max_length`, and each sample's sequence ids (for the target's sentence ids after the shift)."""
        enc = self.tokenizer(**{side: texts}, truncation=True, max_length=self.max_length, padding="longest",
                             return_tensors="np", padding_side="right")
        ids = np.ascontiguousarray(enc["input_ids"], dtype=np.int64)
        lengths = np.asarray(enc["attention_mask"], dtype=np.int64).sum(-1)
        full = lengths.copy()
        cut = [i for i, e in enumerate(enc.encodings) if e.overflowing]
        if cut:
            again = self.tokenizer(**{side: [texts[i] for i in cut]}, truncation=False, verbose=False)["input_ids"]
            full[cut] = [len(x) for x in again]
        sequence = [enc.sequence_ids(b) for b in range(ids.shape[0])]
        sentence = np.zeros(ids.shape, dtype=np.int32)
        for b in range(ids.shape[0]):
            n = int(lengths[b])
            sentence[b, :n] = self.sentence_ids(ids[b, :n].tolist(), sequence[b][:n])
        inputs = {"input_ids": ids, "attention_mask": np.ascontiguousarray(enc["attention_mask"], dtype=np.int64)}
        return EncodedArrays(inputs, lengths, self.token_classes(ids), sentence, len(cut), full), sequence

    def _check_room(self, items: list) -> None:
        """Refuse a max length too short to keep a token of each text besides the special tokens (the
        tokenizer would silently return the pair untruncated)."""
        pair = any(not isinstance(x, str) for x in items)
        need = self.tokenizer.num_special_tokens_to_add(pair=pair) + (2 if pair else 1)
        if self.max_length < need:
            what = "text pairs" if pair else "texts"
            raise AttnkitError(f"max length {self.max_length} is too short for {what} with this tokenizer: "
                               f"it needs at least {need} tokens (special tokens plus one per text)")

    def __call__(self, segments: Sequence[Segment]) -> Batch:
        return Batch.from_arrays(self.encode_arrays(segments))


def pair_decoder_start(config) -> int | None:
    """The token an encoder–decoder's decoder starts with (`decoder_start_token_id`; None for a model of one stack),
    what `Encoder(decoder_start=)` takes to measure (source, target) pairs."""
    if not getattr(config, "is_encoder_decoder", False):
        return None
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(config, "decoder", None), "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise AttnkitError(f"the {config.model_type!r} encoder–decoder's config names no decoder_start_token_id: "
                           "attnkit cannot build the decoder's teacher-forced input")
    return start


# --- images (docs/features.md §10) -------------------------------------------------------------------------------
# From images to batches, as `Encoder` turns texts into them: the images of a corpus (attnkit.corpus.images.ImageItem,
# decoded and converted to RGB there) through the model's own image processor (transformers' AutoImageProcessor:
# resizing, cropping, normalising) into `pixel_values`, with the tokens the vision transformer will make of them: its
# tokens before the patches ([CLS], DeiT's distillation token, DINOv2's registers), then rows × columns patches
# (attnkit/attention/positions.py). Every image of a batch is processed to one size, so every sample has the same
# tokens and nothing is padded or truncated. An image processor that makes images of another size than the model's
# config (DINOv2's crops 224 pixels for a config of 518) is measured through the model's interpolated position
# embeddings (`image_forward_arguments`).


class ImageEncoder:
    """Turns lists of `ImageItem`s into batches (`encode_arrays`, as `attnkit.tokens.Encoder`) for one vision
    transformer: `processor` its image processor, `layout` its tokens (the instrumented model's `Runtime.image`)."""

    def __init__(self, processor, layout: ImageLayout):
        if layout is None:
            raise AttnkitError("images need a vision transformer: this model takes text")
        if not callable(processor) or not hasattr(processor, "preprocess"):
            raise AttnkitError(f"a vision transformer's inputs come from its image processor (AutoImageProcessor), "
                               f"not a {type(processor).__name__}")
        self.processor, self.layout = processor, layout

    def encode_arrays(self, items: Sequence[ImageItem]) -> EncodedArrays:
        """Decode and process `items` into numpy arrays (what worker processes run: no torch operations)."""
        if not items:
            raise AttnkitError("cannot encode an empty batch")
        for item in items:
            if not isinstance(item, ImageItem):
                raise AttnkitError(f"this model is a vision transformer ({self.layout.model_type}): it takes images, "
                                   f"not {type(item).__name__} {item!r:.60}")
        images = [decode_image(item) for item in items]
        pixels = np.ascontiguousarray(self.processor(images=images, return_tensors="np")["pixel_values"],
                                      dtype=np.float32)
        if pixels.ndim != 4 or pixels.shape[1] != self.layout.channels:
            raise AttnkitError(f"the image processor made pixel_values of shape {pixels.shape}, not B × "
                               f"{self.layout.channels} × H × W")
        tokens = ImageTokens(self.layout, tuple(pixels.shape[-2:]))
        rows, cols = tokens.shape
        if rows * cols == 0:
            raise AttnkitError(f"the image processor made {pixels.shape[2]}×{pixels.shape[3]} images, smaller than "
                               f"one {self.layout.patch[0]}×{self.layout.patch[1]} patch")
        L = len(self.layout.prefix) + rows * cols
        classes = image_tokens(tokens, L, "cpu")[0].numpy()
        B = len(items)
        lengths = np.full(B, L, dtype=np.int64)
        return EncodedArrays({"pixel_values": pixels}, lengths, np.ascontiguousarray(np.repeat(classes, B, 0)),
                             np.zeros((B, L), dtype=np.int32), 0, lengths.copy())

    def __call__(self, items: Sequence[ImageItem]):
        return Batch.from_arrays(self.encode_arrays(items))


@functools.cache
def _takes_interpolation(cls) -> bool:
    return "interpolate_pos_encoding" in inspect.signature(cls.forward).parameters


def image_forward_arguments(model, inputs: dict) -> dict:
    """Keyword arguments a forward of `model` on `inputs` needs besides them: `interpolate_pos_encoding=True` when
    the pixel_values are of another size than the config's and the model interpolates its position embeddings only
    when asked (ViT, DeiT, BEiT, CLIP, SigLIP; DINOv2 always does). Empty for text."""
    pixels = inputs.get("pixel_values")
    layout = getattr(getattr(model, RUNTIME_ATTR, None), "image", None)
    if pixels is None or layout is None or tuple(pixels.shape[-2:]) == tuple(layout.image):
        return {}
    return {"interpolate_pos_encoding": True} if _takes_interpolation(type(model)) else {}


def batch_encoder(model, preprocessor, *, max_length: int, split_sentences: bool = False):
    """What builds the batches of `model`: an `ImageEncoder` of its image processor for a vision transformer, else
    an `attnkit.tokens.Encoder` of its tokenizer."""
    layout = getattr(getattr(model, RUNTIME_ATTR, None), "image", None)
    return config_encoder(model.config, preprocessor, layout, max_length=max_length, split_sentences=split_sentences)


def config_encoder(config, preprocessor, layout, *, max_length: int, split_sentences: bool = False):
    """`batch_encoder` of a model known by its `config` alone (a Ray worker's, which holds no model): an
    `ImageEncoder` when `layout` (attnkit.attention.positions.image_layout of the config) is given, else an
    `Encoder` (of pairs for an encoder–decoder)."""
    if layout is not None:
        return ImageEncoder(preprocessor, layout)
    return Encoder(preprocessor, max_length=max_length, split_sentences=split_sentences,
                   decoder_start=pair_decoder_start(config))  # an encoder–decoder measures pairs


# How a token's text is drawn where whitespace would vanish (maps, the report's head view; `shown_token`).
WHITESPACE_MARKS = {"\n": "↵", "\r": "␍", "\t": "⇥"}


def to_str_tokens(tokenizer, text_or_ids) -> list[str]:
    """The tokens of a text as readable strings, one per position (as TransformerLens's `to_str_tokens`).

    `text_or_ids`: a string, tokenised by `tokenizer` with its special tokens (as `attnkit.attention_maps` and
    `extract` add them), or a sequence of token ids (a list, a 1-D array or tensor). Each token is decoded by the
    tokenizer itself (`convert_tokens_to_string`): byte-level BPE's 'Ġis' → ' is' and 'Ċ' → '\\n', SentencePiece's
    '▁is' → ' is'. A token whose vocabulary string already reads as its text (WordPiece's 'the', '##s', special
    tokens) is kept as it is, and so is a token that holds only part of a character's bytes."""
    if isinstance(text_or_ids, str):
        ids = tokenizer(text_or_ids)["input_ids"]
    else:
        ids = text_or_ids.tolist() if hasattr(text_or_ids, "tolist") else list(text_or_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise AttnkitError("to_str_tokens takes a string or a sequence of integer token ids (one text), got "
                               f"{type(text_or_ids).__name__}")
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    out = []
    for tid, tok in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if tid in special or tok is None:
            out.append(tok if tok is not None else "")
            continue
        alone = tokenizer.convert_tokens_to_string([tok])
        if alone == tok or "\ufffd" in alone:
            out.append(tok)
            continue
        # inside a text: a decoder that drops the word boundary at the start of a string (SentencePiece) keeps it
        # after another token, so decode two copies and take the second
        twice = tokenizer.convert_tokens_to_string([tok, tok])
        out.append(twice[len(alone):] if twice.startswith(alone) and len(twice) > len(alone) else alone)
    return out


def shown_token(text: str) -> str:
    """A token's text as drawn on a map or in the report: newlines, carriage returns and tabs as ↵ ␍ ⇥."""
    for ch, mark in WHITESPACE_MARKS.items():
        text = text.replace(ch, mark)
    return text
