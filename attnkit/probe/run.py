"""`attnkit probe`: parse (or read parses), align words with word pieces, run the model with the
word_attention op observing every layer, score every head, write the run directory."""
from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

import numpy as np
import torch

from ..arch.pruning import pruned_head_grid
from ..errors import AttnkitError, arg, print_message
from ..features import DEFAULT_MAX_LENGTH
from ..models import attention_modules, check_max_length, load_model, observing
from ..run.files import PROBE_CSV, PROBE_HEATMAP, PROBE_JSON, PROBE_TABLE, REPORT_FILE
from ..run.identity import IDENTITY_FIELD, model_identity
from ..run.locking import output_directory
from ..run.model_dir import fitted_length
from ..run.outputs import atomic_write, check_output_path, os_errors, write_json
from ..run.overwrite import claim_outputs
from ..run.versions import attnkit_version
from ..words import op_available, word_attention
from .alignment import Alignment, align_offsets, align_word_ids
from .conllu import read_conllu
from .options import (
    SPACY_MODEL,
    ProbeOptions,
    check_probe_options,
    check_spacy,
    missing_spacy_model,
    parser_of,
    probe_outputs,
)
from .scoring import ALL, DIRECTION_QUESTIONS, DIRECTIONS, ProbeScores, attention_only_probe
from .sentences import ROOT, ParsedSentence

log = logging.getLogger("attnkit")

def load_spacy():
    check_spacy()
    import spacy

    try:
        return spacy.load(SPACY_MODEL)
    except OSError:
        raise AttnkitError(missing_spacy_model()) from None


def parse_texts(texts: list[str], nlp=None) -> list[ParsedSentence]:
    """Dependency parses of `texts` by spaCy (one ParsedSentence per text, all its sentences together)."""
    nlp = nlp or load_spacy()
    out = []
    for i, doc in enumerate(nlp.pipe(texts)):
        out.append(ParsedSentence(
            words=[t.text for t in doc], heads=[ROOT if t.head.i == t.i else t.head.i for t in doc],
            relations=[t.dep_ for t in doc], text=doc.text, spans=[(t.idx, t.idx + len(t.text)) for t in doc],
            where=f"text {i + 1}"))
    return out


def load_sentences(opts: ProbeOptions) -> tuple[list[ParsedSentence], str]:
    parser = parser_of(opts.paths, opts.parser)
    if parser == "conllu":
        if not opts.paths:
            raise AttnkitError(f"{arg('parser', 'conllu')} needs CoNLL-U files")
        sents = [s for p in opts.paths for s in read_conllu(p)]
        return sents[: opts.limit] if opts.limit else sents, parser
    from ..corpus import open_corpus

    texts = []
    for seg in open_corpus(opts.paths, opts.fmt, columns=opts.columns, text_unit="line"):
        for t in (seg if isinstance(seg, tuple) else (seg,)):
            if t.strip():
                texts.append(t.strip())
        if opts.limit and len(texts) >= opts.limit:
            texts = texts[: opts.limit]
            break
    if not texts:
        raise AttnkitError("the corpus has no text to parse")
    return parse_texts(texts), parser


# --- encoding ----------------------------------------------------------------------------------------------
def encode(tokenizer, sentences: list[ParsedSentence], max_length: int):
    """(model inputs, per-sentence Alignment). Pre-split words go through `word_ids()`; sentences with
    character spans, or tokenizers that refuse pre-split words, through character offsets."""
    if all(s.spans is None for s in sentences):
        try:
            enc = tokenizer([s.words for s in sentences], is_split_into_words=True, truncation=True,
                            max_length=max_length, padding=True, return_tensors="pt")
            aligns = [align_word_ids(enc.word_ids(i), len(s.words)) for i, s in enumerate(sentences)]
            return _model_inputs(enc), aligns
        except Exception as exc:  # e.g. byte-level BPE without add_prefix_space
            log.info("pre-split words refused by the tokenizer (%s); aligning by offsets", exc)
    texts, spans = [], []
    for s in sentences:
        if s.spans is not None:
            texts.append(s.text)
            spans.append(s.spans)
        else:  # join pre-split words with single spaces
            pos, sp = 0, []
            for w in s.words:
                sp.append((pos, pos + len(w)))
                pos += len(w) + 1
            texts.append(" ".join(s.words))
            spans.append(sp)
    enc = tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_tensors="pt",
                    return_offsets_mapping=True, return_special_tokens_mask=True)
    aligns = []
    for i, text in enumerate(texts):
        n = int(enc["attention_mask"][i].sum())
        offsets = enc["offset_mapping"][i, :n].tolist()
        special = enc["special_tokens_mask"][i, :n].bool().tolist()
        aligns.append(align_offsets(offsets, special, spans[i], text, truncated=n >= max_length))
    return _model_inputs(enc), aligns


def _model_inputs(enc) -> dict:
    return {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}


def word_attention_batch(model, inputs: dict, aligns: list[Alignment], num_words: int, backend: str):
    """Word-level attention of every layer: fp32 tensor (layers, B, H, W, W), from the word_attention op
    called on each layer's q and k during one forward (no attention map is kept)."""
    n_layers = len(attention_modules(model))
    dev = next(model.parameters()).device
    B, L = inputs["input_ids"].shape
    wid = torch.full((B, L), -1, dtype=torch.int32)
    for b, a in enumerate(aligns):
        wid[b, : len(a.word_id)] = torch.tensor(a.word_id, dtype=torch.int32)
    wid = wid.to(dev)
    got: dict[int, torch.Tensor] = {}

    def observe(layer, query, key, lengths, scaling):
        got[layer] = word_attention(query, key, lengths, wid, num_words, scaling=scaling, backend=backend).words.cpu()

    with observing(model, [observe]), torch.inference_mode():
        model(**{k: v.to(dev) for k, v in inputs.items()})
    if sorted(got) != list(range(n_layers)):
        raise AttnkitError(f"word attention came from layers {sorted(got)}, expected 0..{n_layers - 1}")
    return torch.stack([got[i] for i in range(n_layers)])


def score_sentences(model, tokenizer, sentences, *, max_length=None, batch_size=16, backend="auto",
                    keep_pairs=True, quiet=True, count_root=False, baseline="any") -> tuple[ProbeScores, dict]:
    """Run the model over parsed sentences and score every head; returns (scores, alignment counts).
    `count_root` and `baseline` as in `ProbeScores`. `max_length`: tokens per sentence, refused past the model's
    positions; None: DEFAULT_MAX_LENGTH, or the model's positions where it has fewer."""
    from tqdm import tqdm

    if max_length is None:
        max_length = fitted_length(model, DEFAULT_MAX_LENGTH)
    check_max_length(model, max_length)
    mods = attention_modules(model)
    n_heads = int(model.config.num_attention_heads)
    scores = ProbeScores(len(mods), n_heads, keep_pairs=keep_pairs, count_root=count_root, baseline=baseline,
                         removed=~pruned_head_grid(model))
    counts = {"words": 0, "unaligned": 0, "truncated": 0, "split": 0, "no_piece": 0}
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i].words))  # less padding
    with tqdm(total=len(sentences), disable=quiet, desc="probe", unit="sent") as bar:
        for start in range(0, len(order), batch_size):
            batch = [sentences[i] for i in order[start:start + batch_size]]
            inputs, aligns = encode(tokenizer, batch, max_length)
            W = max(len(s.words) for s in batch)
            attn = word_attention_batch(model, inputs, aligns, W, backend).numpy()
            for b, (s, a) in enumerate(zip(batch, aligns)):
                w = len(s.words)
                scores.add(attn[:, b, :, :w, :w], s.heads, s.relations, a.aligned)
                counts["words"] += w
                counts["unaligned"] += a.n_unaligned
                counts["truncated"] += a.n_truncated
                counts["split"] += a.n_split
                counts["no_piece"] += a.n_no_piece
            bar.update(len(batch))
    return scores, counts


# --- outputs -----------------------------------------------------------------------------------------------
def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def best_head_table(scores: ProbeScores, min_count: int) -> str:
    """Clark et al.'s Table 2 layout: per relation the best head, its accuracy and the offset baseline."""
    lines = [f"{'Relation':<14} {'Count':>6}  {'Head':<6} {'Direction':<10} {'Accuracy':>8}  {'Baseline':>14}  "
             + "  ".join(f"{d:>14}" for d in DIRECTIONS)]
    for r in scores.relations(min_count):
        b = scores.best(r)
        best = b["best"]
        off = "none" if b["baseline_offset"] is None else f"{b['baseline_offset']:+d}"
        base = f"{100 * b['baseline_accuracy']:.1f} ({off})"
        dirs = [f"{100 * b[d]['accuracy']:5.1f} {head_name(b[d]['layer'], b[d]['head']):<7}" for d in DIRECTIONS]
        lines.append(f"{r:<14} {b['count']:>6}  {head_name(best['layer'], best['head']):<6} {best['direction']:<10} "
                     f"{100 * best['accuracy']:>8.1f}  {base:>14}  " + "  ".join(f"{x:>14}" for x in dirs))
    return "\n".join(lines)


LABEL_CHARS = 9  # a relation name in a cell is cut to this many characters


def heatmap(scores: ProbeScores, relation: str | None, min_count: int):
    """Layers × heads accuracy over the baseline (the better direction minus the relation's best fixed offset) for
    `relation`, or, per head, the relation it beats its baseline by most, named in the cell. Accuracy over the
    baseline is the finding: a relation that a fixed offset already gets right is not one a head has learnt."""
    from ..plotting import head_grid, plt

    def gain(r):
        return scores.best_accuracy(r) - scores.baseline(r)[1]

    if relation is not None:
        if relation not in scores.rel:
            raise AttnkitError(f"{arg('relation')} {relation!r} does not occur; relations: "
                               f"{', '.join(scores.relations())}")
        grid = gain(relation)
        off, base = scores.baseline(relation)
        where = f"offset {off:+d}" if off is not None else "no offset ever right"
        title = f"{relation}: accuracy over the baseline ({where}: {base:.2f})"
        labels = [[f"{v:+.2f}" if np.isfinite(v) else "removed" for v in row] for row in grid]
    else:
        rels = [r for r in scores.relations(min_count) if r != ALL] or [ALL]
        stack = np.stack([gain(r) for r in rels])
        grid = stack.max(0)  # NaN for a removed head
        names = np.asarray(rels)[np.nan_to_num(stack, nan=-np.inf).argmax(0)]
        title = "per head, the relation it beats its baseline by most: accuracy over the baseline"
        labels = [[f"{n[:LABEL_CHARS]}\n{v:+.2f}" if np.isfinite(v) else "removed" for n, v in zip(nrow, vrow)]
                  for nrow, vrow in zip(names, grid)]
    lim = max(float(np.nanmax(np.abs(grid))), 0.05) if np.isfinite(grid).any() else 1.0
    width = 0.75 if relation is None else 0.5
    fig, ax = plt.subplots(figsize=(1.6 + width * scores.n_heads, 1.2 + (0.5 if relation is None else 0.4)
                                    * scores.n_layers))
    shown = scores.n_heads * scores.n_layers <= 400
    head_grid(ax, grid, labels=labels if shown else None, cmap="RdBu", vmin=-lim, vmax=lim, fontsize=6.5,
              colorbar={"fraction": 0.04, "label": "accuracy − baseline"})
    for t in ax.texts:  # dark text on pale cells, white on saturated ones
        x, y = t.get_position()
        t.set_color("white" if abs(np.nan_to_num(grid[int(round(y)), int(round(x))])) > 0.6 * lim else "black")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def _write(out: Path, scores: ProbeScores, table: str, summary: dict, relation: str | None, min_count: int) -> None:
    """probe.csv, best_heads.txt, probe_heatmap.png and probe.json, each written atomically."""
    from ..plotting import save_figure

    rows = scores.rows()
    buf = io.StringIO(newline="")
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out / PROBE_CSV, lambda f: f.write(buf.getvalue().encode("utf-8")))
    atomic_write(out / PROBE_TABLE, lambda f: f.write((table + "\n").encode("utf-8")))
    save_figure(heatmap(scores, relation, min_count), out, PROBE_HEATMAP, svg=False)
    write_json(out / PROBE_JSON, summary)


def run_probe(opts: ProbeOptions, echo=print_message) -> dict:
    """Run `attnkit probe` with `opts`: write the probe run directory (probe.csv, probe.json, best_heads.txt,
    probe_heatmap.png; docs/probes.md) and report through `echo`; returns the summary (probe.json)."""
    out = Path(check_output_path(opts.out))
    check_probe_options(opts)  # also checked by the command line before torch loads
    inputs = [("the model", opts.model_path), *(("a corpus input", p, True) for p in opts.paths)]
    with output_directory(out, "attnkit probe", inputs=inputs):  # the one write path: checked, created, locked
        claim = claim_outputs(probe_outputs(out), opts.overwrite, stale=[out / REPORT_FILE])
        sentences, parser = load_sentences(opts)
        model, tokenizer = load_model(opts.model_path, device=opts.device, dtype=opts.dtype, max_length=opts.max_length)
        max_length = opts.max_length or fitted_length(model, DEFAULT_MAX_LENGTH)
        if max_length < DEFAULT_MAX_LENGTH and opts.max_length is None and not opts.quiet:
            echo(f"attnkit probe: sentences cut to the model's {max_length} positions (the default "
                 f"{arg('max_length')} is {DEFAULT_MAX_LENGTH})", err=True)
        scores, counts = score_sentences(model, tokenizer, sentences, max_length=max_length,
                                         batch_size=opts.batch_size, backend=opts.backend, quiet=opts.quiet,
                                         count_root=opts.count_root, baseline=opts.baseline)
        if ALL not in scores.rel:
            raise AttnkitError("no dependency could be scored (every dependent or head unaligned, or only roots)")
        if opts.relation is not None and opts.relation not in scores.rel:
            raise AttnkitError(f"{arg('relation')} {opts.relation!r} does not occur; relations: "
                               f"{', '.join(scores.relations())}")
        probe = attention_only_probe(scores, opts.train_fraction, opts.seed)
        table = best_head_table(scores, opts.min_count)
        dev_type = next(model.parameters()).device.type
        wa_backend = f"fused-{dev_type}" if opts.backend != "reference" and op_available(dev_type) else "reference"
        summary = {
            "model": opts.model_path or "default (embedded MiniLM)",
            IDENTITY_FIELD: model_identity(model, opts.model_path),
            "inputs": [str(p) for p in opts.paths], "parser": parser,
            "parser_model": SPACY_MODEL if parser == "spacy" else None,
            "layers": scores.n_layers, "heads": scores.n_heads,
            "removed_heads": [[int(l), int(h)] for l, h in np.argwhere(scores.removed)],
            "sentences": scores.n_sentences, "words": counts["words"],
            "unaligned_words": counts["unaligned"],
            "unaligned_detail": {k: counts[k] for k in ("truncated", "split", "no_piece")},
            "root_words": scores.n_root, "scored_dependencies": scores.rel[ALL].n,
            "directions": dict(DIRECTION_QUESTIONS),
            "skipped_dependencies": scores.n_skipped,
            "relations": {r: scores.best(r) for r in scores.relations()},
            "attention_only_probe": probe,
            "settings": {"max_length": max_length, "batch_size": opts.batch_size, "dtype": opts.dtype,
                         "min_count": opts.min_count, "relation": opts.relation, "backend": opts.backend,
                         "count_root": opts.count_root, "baseline": opts.baseline,
                         "word_attention_backend": wa_backend},
            "attnkit_version": attnkit_version(),
            "files": {"csv": PROBE_CSV, "table": PROBE_TABLE, "heatmap": f"{PROBE_HEATMAP}.png"},
        }
        with os_errors(f"write into {out}"):
            _write(out, scores, table, summary, opts.relation, opts.min_count)
            claim.remove_stale()
    echo(f"{scores.n_sentences} sentences, {counts['words']} words ({counts['unaligned']} unaligned: "
         f"{counts['truncated']} truncated, {counts['split']} sharing a piece, {counts['no_piece']} without a piece), "
         f"{scores.rel[ALL].n} dependencies scored, {scores.n_skipped} skipped"
         + (f"; left out {int(scores.removed.sum())} head(s) removed by pruning" if scores.removed.any() else ""))
    echo("Best head per relation (heads 0-based; Clark et al. write layer-head 1-based: L7H9 = 8-10); "
         "accuracy and baseline in %; dep->head: the word the dependent attends to most is its head; dep<-head: "
         "the word that attends most to the dependent is its head (Clark's transposed mode)"
         + ("; root words counted (always wrong)" if opts.count_root else "")
         + ("; baseline offsets -3..2 as Clark's code" if opts.baseline == "clark" else "") + ":")
    echo(table)
    if "uas" in probe:
        echo(f"attention-only probe (logistic, {probe['features']} features): UAS {100 * probe['uas']:.1f} on "
             f"{probe['test_sentences']} held-out sentences ({probe['test_dependents']} dependents)")
    else:
        echo(f"attention-only probe skipped: {probe['skipped']}")
    echo(f"wrote {out}/{PROBE_CSV}, {PROBE_JSON}, {PROBE_TABLE}, {PROBE_HEATMAP}.png")
    if claim.removed_message():
        echo(claim.removed_message(), err=True)
    return summary
