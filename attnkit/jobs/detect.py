"""Which heads of a decoder attend to the previous token, to an earlier copy of the current token, or to the token
after that copy (induction), and which retrieve a needle from a long context: `attnkit.detect_heads`
(docs/analysis.md, "Detecting heads"; `attnkit detect-heads MODEL -o RUN`).

Repeated random tokens (Olsson et al. 2022). `n_sequences` sequences of `length` tokens r_0 … r_{R−1} (R =
`length`), drawn uniformly with `seed` from the vocabulary without its special tokens, are each repeated once:
r r, 2R tokens, after the model's BOS where its tokenizer adds one (SmolLM2's adds none). With `input_ids`
(B × 2R) the sequences are used exactly as given, nothing added. For every query position s of the second repeat
(positions R … 2R − 1 of the repeated part, o + R … o + 2R − 1 of the input with o = 1 after a BOS, else 0):

    previous  = A[s, s − 1]        duplicate = A[s, s − R]        induction = A[s, s − R + 1]

each averaged over those positions and over the sequences (every position weighs the same). Each is a "mass on a
given key per row", computed by the `attnkit::row_stats` op (attnkit/words.py) from each layer's q and k with a
per-row target key; no L × L map is made.

Retrieval (Wu et al. 2024; `kinds=("retrieval",)`, needle-in-a-haystack, teacher-forced): the recipe is in
`retrieval_inputs` and docs/analysis.md. A head scores the share of answer tokens for which the arg-max key of the
row predicting that token is the same token inside the needle.

Heads removed by pruning (attnkit/arch/pruning.py) get NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..arch.pruning import pruned_head_grid
from ..corpus import default_corpus_path
from ..errors import AttnkitError, arg, check_int
from ..models import attention_modules, given_by_path, max_positions, observing, resolve_model
from ..words import row_stats
from .detect_options import (
    KINDS,
    REPEAT_KINDS,
    DetectOptions,
    check_corpus_used,
    check_kinds,
    check_positions,
    check_repeat_length,
    detect_inputs,
    detect_outputs,
    model_of,
)

BATCH = 16  # sequences per forward
NEEDLE_WORDS = 6  # words of the needle's value (the tokens the answer copies)
HAYSTACK = 480  # tokens of haystack per retrieval input by default
DEPTHS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def adds_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text, or None when it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def _draw_vocab(tokenizer) -> np.ndarray:
    """The ids random sequences are drawn from: the tokenizer's, without its special tokens."""
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    if len(vocab) < 2:
        raise AttnkitError("the tokenizer has fewer than two non-special tokens to draw random sequences from")
    return vocab


def repeated_chunks(tokenizer, length: int, n_sequences: int, seed: int, chunk: int = BATCH):
    """(ids, o) for each block of at most `chunk` of the `n_sequences` sequences, in order: random non-special
    tokens repeated once, after the BOS the tokenizer adds (o = 1) or nothing (o = 0). Drawn block by block from
    one seeded generator, so the blocks together are the sequences `repeated_tokens` gives at once, and memory
    does not grow with `n_sequences`."""
    vocab = _draw_vocab(tokenizer)
    rng = np.random.default_rng(seed)
    bos = adds_bos(tokenizer)
    for start in range(0, n_sequences, chunk):
        b = min(chunk, n_sequences - start)
        r = vocab[rng.integers(0, len(vocab), size=(b, length))]
        ids = torch.from_numpy(np.concatenate([r, r], axis=1))
        if bos is None:
            yield ids, 0
        else:
            yield torch.cat([torch.full((b, 1), bos, dtype=torch.int64), ids], dim=1), 1


def repeated_tokens(tokenizer, length: int, n_sequences: int, seed: int) -> tuple[torch.Tensor, int]:
    """(n_sequences × (o + 2·length) int64 ids, o): every block of `repeated_chunks` at once."""
    blocks = list(repeated_chunks(tokenizer, length, n_sequences, seed))
    return torch.cat([ids for ids, _ in blocks]), blocks[0][1]


def repeat_targets(kind: str, B: int, offset: int, R: int) -> torch.Tensor:
    """B × (offset + 2R) target keys of `kind` for the rows of the second repeat (−1 elsewhere)."""
    L = offset + 2 * R
    target = torch.full((B, L), -1, dtype=torch.int64)
    s = torch.arange(offset + R, L)
    back = {"previous": 1, "duplicate": R, "induction": R - 1}[kind]
    target[:, s] = (s - back)[None, :]
    return target


@dataclass
class _Scores:
    """Sums of a statistic per (layer, head) and the rows counted."""

    sums: np.ndarray
    rows: np.ndarray

    def mean(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.sums / self.rows


class _Observer:
    """Per layer, the row statistics of every head of the current batch: the masses on each kind's targets, and
    where `hits` is given (B × L expected keys, −1 elsewhere), how often the arg-max is that key."""

    def __init__(self, n_layers: int, n_heads: int, kinds, backend: str = "auto"):
        self.kinds, self.backend = kinds, backend
        self.scores = {k: _Scores(np.zeros((n_layers, n_heads)), np.zeros((n_layers, n_heads))) for k in kinds}
        self.targets: dict = {}

    decoder_arguments = True  # takes a decoder's attention arguments (attnkit.hf_attention: observers)

    def __call__(self, layer, query, key, lengths, scaling, *, kv_head=None, causal=True, sliding_window=None,
                 softcap=None, sink=None, symmetric_window=False, **_):
        if symmetric_window:  # (row_stats computes one-sided windows only; _check_model admits causal models)
            raise AttnkitError(f"detect-heads: layer {layer} has a bidirectional sliding window (ModernBERT's local "
                               "layers), which its row statistics do not compute")
        if query.shape[1] == 0:
            return
        with torch.no_grad():
            for kind, target in self.targets.items():
                t = target.to(query.device)
                st = row_stats(query, key, lengths, t if kind != "retrieval" else None, scaling=scaling,
                               kv_head=kv_head, causal=causal, sliding_window=sliding_window, softcap=softcap,
                               sink=sink, backend=self.backend)
                rows = t >= 0  # B×L
                if kind == "retrieval":
                    value = (st.argmax_key == t[:, None, :]) & rows[:, None, :]
                else:
                    value = st.target_mass * rows[:, None, :]
                sc = self.scores[kind]
                sc.sums[layer] += value.double().sum((0, 2)).cpu().numpy()
                sc.rows[layer] += float(rows.sum())


def _check_model(model) -> None:
    if not any(getattr(m, "is_causal", False) for m in attention_modules(model)):
        raise AttnkitError(f"detect_heads measures causal language models (decoders); this "
                           f"{model.config.model_type!r} model's attention is not causal")


def _run(model, batches, kinds, n_layers, n_heads, bar=None) -> dict[str, np.ndarray]:
    """Forward every (input_ids, {kind: targets}) batch with the observer attached; mean score per kind. The
    batches may be a generator: one is in memory at a time. `bar` counts their sequences."""
    obs = _Observer(n_layers, n_heads, kinds)
    dev = next(model.parameters()).device
    with torch.inference_mode(), observing(model, [obs]):
        for ids, targets in batches:
            obs.targets = targets
            model(input_ids=ids.to(dev), attention_mask=torch.ones_like(ids).to(dev))
            if bar is not None:
                bar.update(len(ids))
    return {k: obs.scores[k].mean() for k in kinds}


def _check_input_ids(input_ids) -> torch.Tensor:
    """`input_ids` as B × 2R int64 token ids, or an AttnkitError naming what is wrong (before the model loads)."""
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise AttnkitError(f"{arg('input_ids')} must be B × 2R integer token ids: {exc}") from None
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise AttnkitError(f"{arg('input_ids')} must be integer token ids, got {str(ids.dtype).replace('torch.', '')} "
                           "values (ids are never rounded)")
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or ids.shape[1] % 2:
        raise AttnkitError(f"{arg('input_ids')} must be B × 2R token ids (a sequence repeated once), got "
                           f"shape {tuple(ids.shape)}")
    return ids.to(torch.int64)


def _check_vocabulary(model, ids: torch.Tensor) -> None:
    n = int(model.get_input_embeddings().num_embeddings)
    bad = (ids < 0) | (ids >= n)
    if bool(bad.any()):
        b, t = (int(x) for x in bad.nonzero()[0])
        raise AttnkitError(f"{arg('input_ids')} holds {int(ids[b, t])} (sequence {b}, position {t}), outside the "
                           f"model's vocabulary of {n} token ids (0 … {n - 1})")


def _check_corpus(corpus, kinds) -> list[str] | None:
    """The retrieval corpus as a list of texts; refused where it would be misread (one string, read as one text per
    character) or not used (no retrieval among `kinds`)."""
    if corpus is None:
        return None
    check_corpus_used(corpus, kinds)
    if isinstance(corpus, (str, bytes)):
        raise AttnkitError(f"{arg('corpus')} must be texts (e.g. a list of strings), not one string: it would be read "
                           "as one text per character; wrap it in a list")
    try:
        texts = list(corpus)
    except TypeError:
        raise AttnkitError(f"{arg('corpus')} must be texts (e.g. a list of strings), got "
                           f"{type(corpus).__name__}") from None
    bad = [t for t in texts if not isinstance(t, str)]
    if bad:
        raise AttnkitError(f"{arg('corpus')} must hold texts (strings), got {type(bad[0]).__name__}")
    return texts


def _bar(progress: bool, total: int):
    if not progress:
        return None
    from ..engine.progress import FIRST_DRAW_S, bar_class

    return bar_class()(total=total, unit="seq", desc="detect-heads", dynamic_ncols=True, delay=FIRST_DRAW_S)


def detect_heads(model=None, *, kinds=REPEAT_KINDS, length: int = 50, n_sequences: int = 100, seed: int = 0,
                 input_ids=None, tokenizer=None, corpus=None, haystack: int = HAYSTACK, progress: bool = False):
    """A pandas DataFrame with a row per (layer, head) and a column per kind in `kinds` (module docstring):
    previous-token, duplicate-token and induction scores on repeated random tokens, and retrieval scores on
    needle-in-a-haystack inputs built from `corpus` (texts; default: attnkit's own default corpus).

    Everything that needs no model is checked before it loads (a model given by its directory: its positions from
    config.json); the sequences are drawn and scored in blocks of BATCH, so memory does not grow with
    `n_sequences`. `progress`: a bar of the sequences scored on stderr."""
    import pandas as pd

    from ..embedded import model_config

    kinds = check_kinds(kinds)
    corpus = _check_corpus(corpus, kinds)
    repeat = [k for k in kinds if k in REPEAT_KINDS]
    check_int(n_sequences, "n_sequences")
    check_int(seed, "seed")
    check_int(haystack, "haystack")
    ids = None
    if repeat and input_ids is not None:
        ids = _check_input_ids(input_ids)
        R, what, remedy = ids.shape[1] // 2, "the sequences of input_ids", f"shorten {arg('input_ids')}"
    elif repeat:
        R = check_int(length, "length")
        what, remedy = f"the repeated sequences (2 × {R} tokens", f"lower {arg('length')}"
    if repeat and "induction" in repeat:
        check_repeat_length(R, "sequences")
    if given_by_path(model):  # positions: config.json
        cfg = model_config(model)
        if cfg is not None and repeat:
            check_positions(cfg, 2 * R, what + (")" if ids is None else ""), remedy)
        if cfg is not None and "retrieval" in kinds:
            check_positions(cfg, haystack, f"haystacks of {arg('haystack')} tokens", f"lower {arg('haystack')}")
    model, tokenizer = resolve_model(model, tokenizer)
    cfg = model.config
    n_layers, n_heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    _check_model(model)
    scores: dict[str, np.ndarray] = {}
    if repeat:
        if ids is not None:
            _check_vocabulary(model, ids)
            check_positions(model, ids.shape[1], what, remedy)
            blocks = ((ids[i:i + BATCH], 0) for i in range(0, len(ids), BATCH))
            total = len(ids)
        else:
            offset = 1 if adds_bos(tokenizer) is not None else 0
            check_positions(model, offset + 2 * R, what + (" and a BOS)" if offset else ")"), remedy)
            blocks = repeated_chunks(tokenizer, R, n_sequences, seed)
            total = n_sequences
        batches = ((b, {k: repeat_targets(k, len(b), o, R) for k in repeat}) for b, o in blocks)
        bar = _bar(progress, total)
        try:
            scores.update(_run(model, batches, repeat, n_layers, n_heads, bar))
        finally:
            if bar is not None:
                bar.close()
    if "retrieval" in kinds:
        limit = max_positions(model)

        def checked(pairs):
            for x, exp in pairs:
                if limit is not None and len(x) > limit:
                    check_positions(model, len(x), "the needle-in-a-haystack inputs",
                                     "the retrieval recipe needs a model with that many positions (or a lower "
                                     f"{arg('haystack')})")
                yield x[None], {"retrieval": exp[None]}

        bar = _bar(progress, n_sequences)
        try:
            scores.update(_run(model, checked(iter_retrieval_inputs(tokenizer, corpus, n_sequences, seed, haystack)),
                               ["retrieval"], n_layers, n_heads, bar))
        finally:
            if bar is not None:
                bar.close()
    kept = pruned_head_grid(model)
    layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    data = {"layer": layer.ravel(), "head": head.ravel()}
    for k in kinds:
        data[k] = np.where(kept, scores[k], np.nan).ravel()
    return pd.DataFrame(data)


# --- retrieval: needle in a haystack ------------------------------------------------------------------------
def _words(texts) -> list[str]:
    return [w for t in texts for w in t.split() if w.isalpha()]


def retrieval_inputs(tokenizer, corpus, n: int, seed: int, haystack: int = HAYSTACK):
    """(ids, expected): the lists of the `n` inputs of `iter_retrieval_inputs`, all at once."""
    pairs = list(iter_retrieval_inputs(tokenizer, corpus, n, seed, haystack))
    return [x for x, _ in pairs], [e for _, e in pairs]


def iter_retrieval_inputs(tokenizer, corpus, n: int, seed: int, haystack: int = HAYSTACK):
    """`n` needle-in-a-haystack inputs (token ids) and, per input, the B × L expected arg-max keys (−1 except at the
    rows that predict an answer token).

    Input i: the haystack (whole sentences of the corpus, in order from a seeded start, about `haystack` tokens)
    with the needle sentence "The secret words are: V." inserted between two of its sentences at depth
    DEPTHS[i % 11] (0: before the first, 1: after the last), then the question "What are the secret words? The
    secret words are:" and the answer V teacher-forced. V is NEEDLE_WORDS words drawn with the seed from the
    corpus's words. The needle's value and the answer are the same token ids (tokenised once and copied), so the
    answer token j is a copy of needle position p_j; the row that predicts it (the token before it) is expected
    to have its arg-max at p_j."""
    texts = list(corpus) if corpus is not None else _default_corpus()
    sentences = [s.strip() for t in texts for s in _split_sentences(t) if s.strip()]
    words = _words(sentences)
    if len(sentences) < 2 or len(words) < NEEDLE_WORDS:
        raise AttnkitError("the retrieval corpus needs at least two sentences and some words to build haystacks")

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rng = np.random.default_rng(seed)
    bos = adds_bos(tokenizer)
    sent_ids = [enc(" " + s) for s in sentences]
    for i in range(n):
        value = enc(" " + " ".join(rng.choice(words, size=NEEDLE_WORDS)))
        start = int(rng.integers(0, len(sentences)))
        hay: list[list[int]] = []
        total, j = 0, start
        while total < haystack:
            hay.append(sent_ids[j % len(sentences)])
            total += len(hay[-1])
            j += 1
        cut = int(round(DEPTHS[i % len(DEPTHS)] * len(hay)))
        before = [t for s in hay[:cut] for t in s]
        needle_prefix = enc(" The secret words are:")
        ids = ([bos] if bos is not None else []) + before + needle_prefix
        value_at = len(ids)
        ids += value + enc(".") + [t for s in hay[cut:] for t in s]
        ids += enc(" What are the secret words? The secret words are:")
        answer_at = len(ids)
        ids += value
        expected = torch.full((len(ids),), -1, dtype=torch.int64)
        for j in range(len(value)):
            expected[answer_at + j - 1] = value_at + j
        yield torch.tensor(ids, dtype=torch.int64), expected


def _split_sentences(text: str) -> list[str]:
    import re

    return re.split(r"(?<=[.!?])\s+", text)


def _default_corpus() -> list[str]:
    return default_corpus_path().read_text(encoding="utf-8").splitlines()


__all__ = ["KINDS", "detect_heads", "iter_retrieval_inputs", "repeated_chunks", "repeated_tokens", "retrieval_inputs"]


# --- the job behind `attnkit detect-heads` --------------------------------------------------------------------
def run_detect_heads(opts: DetectOptions):
    """Score every head and write OUT/detected_heads.csv (the DataFrame of `detect_heads`) and
    OUT/detected_heads.json (the settings: docs/files.md). Returns (the DataFrame, the paths written, what
    `overwrite` removed or None)."""
    import os
    import time
    from pathlib import Path

    from ..corpus import read_corpus
    from ..models import load_model
    from ..run.files import DETECTED_HEADS_FILE, DETECTED_HEADS_META, REPORT_FILE
    from ..run.identity import IDENTITY_FIELD, model_identity
    from ..run.locking import output_directory
    from ..run.outputs import atomic_write, write_json
    from ..run.overwrite import claim_outputs

    kinds = check_kinds(opts.kinds)
    with output_directory(opts.out, "attnkit detect-heads", inputs=detect_inputs(opts)) as out:  # the one write path
        claim = claim_outputs(detect_outputs(out), opts.overwrite, stale=[out / REPORT_FILE])
        corpus = None
        if opts.corpus is not None:
            corpus = [t for seg in read_corpus(opts.corpus, text_unit="line")
                      for t in ((seg,) if isinstance(seg, str) else seg)]
        t0 = time.perf_counter()
        model, tok = load_model(model_of(opts), device=opts.device, task="causal-lm")
        df = detect_heads((model, tok), kinds=kinds, length=opts.length, n_sequences=opts.n_sequences,
                          seed=opts.seed, corpus=corpus, progress=not opts.quiet)
        atomic_write(out / DETECTED_HEADS_FILE, lambda f: f.write(df.to_csv(index=False).encode("utf-8")))
        bos = adds_bos(tok)
        meta = {"model": opts.model, "model_type": model.config.model_type,
                IDENTITY_FIELD: model_identity(model, opts.model), "kinds": list(kinds),
                "length": opts.length, "n_sequences": opts.n_sequences, "seed": opts.seed,
                "bos": bos, "corpus": (None if "retrieval" not in kinds else os.path.abspath(opts.corpus)
                                       if opts.corpus else "attnkit default corpus"),
                "n_layers": int(model.config.num_hidden_layers), "n_heads": int(model.config.num_attention_heads),
                "seconds": round(time.perf_counter() - t0, 1)}
        write_json(out / DETECTED_HEADS_META, meta)
        claim.remove_stale()
    return df, [Path(p) for p in detect_outputs(out)], claim.removed_message()
