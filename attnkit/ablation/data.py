"""Reading and checking the data of `attnkit ablate` (`--data`), without a model and without torch: the command
line reads it before torch is imported (`attnkit.ablation.options.preflight_ablate`), so that a file with a wrong
column, no rows or a constant score is refused at once; the tasks (tasks.py, patching.py) read their examples
through the same functions. Formats: docs/interventions.md. This module imports nothing heavy
(tests/test_cli_startup.py holds it to that)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ..corpus import open_corpus, read_corpus, read_table
from ..errors import AttnkitError, arg, check_int
from ..run.schemas import SQUAD_SCHEMA, load_json
from .names import TASKS


def check_data_file(path: str, kind: str, *, folder_ok: bool = False) -> None:
    """Refuse --data that is not a regular file (or, with `folder_ok`, a directory), naming what it is: missing,
    a directory, a device such as /dev/null, a FIFO, a socket."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise AttnkitError(f"data file {path!r} not found") from None
    except OSError as exc:
        raise AttnkitError(f"cannot read data file {path!r}: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode) or (folder_ok and stat.S_ISDIR(mode)):
        return
    what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise AttnkitError(f"data path {path!r} is {what}, not a file: give the {kind} file")


def subset(n: int, limit: int | None) -> list[int]:
    """Indices of the examples used under `limit`: all of them, or `limit` evenly spaced over the file.
    Data files are often sorted by source (STS-B dev starts with 500+ MSRvid captions; SQuAD by
    article), so the first N would be a biased sample; evenly spaced indices are deterministic."""
    k = n if limit is None else min(n, check_int(limit, "limit"))
    if k == n:
        return list(range(n))
    return sorted(set(int(i) for i in np.linspace(0, n - 1, k).round()))


def parse_score(path: str, line: int, raw: str) -> float:
    """A gold similarity score: a finite number, else an error naming the file and line."""
    try:
        value = float(raw)
    except ValueError:
        raise AttnkitError(f"{path}:{line}: score {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise AttnkitError(f"{path}:{line}: score {raw!r} is not a finite number")
    return value


def check_gold_varies(path: str, gold, metric: str = "Spearman and Pearson correlations") -> None:
    """Correlations with a constant gold are undefined (they would come out NaN): refuse, naming the file."""
    gold = np.asarray(gold, dtype=np.float64)
    if gold.size < 2:
        raise AttnkitError(f"{path}: {gold.size} example(s) evaluated, but the {metric} need at least two")
    if np.ptp(gold) == 0:
        raise AttnkitError(f"{path}: every gold score of the {gold.size} examples evaluated is {gold[0]:g}, so the "
                           f"{metric} are undefined; use a file (or {arg('limit')}/{arg('sample')}) whose scores vary")


# --- GLUE with a sequence-classification model --------------------------------------------------------
@dataclass(frozen=True)
class GlueSpec:
    text: tuple  # column names (or indices for header-less files) of the one or two texts
    label: object
    labels: tuple | None  # label names in index order; None: regression
    metrics: tuple
    main: str


GLUE = {
    "cola": GlueSpec((3,), 1, ("0", "1"), ("mcc", "accuracy"), "mcc"),
    "sst-2": GlueSpec(("sentence",), "label", ("0", "1"), ("accuracy",), "accuracy"),
    "mrpc": GlueSpec(("#1 string", "#2 string"), "quality", ("0", "1"), ("accuracy", "f1"), "acc_and_f1"),
    "qqp": GlueSpec(("question1", "question2"), "is_duplicate", ("0", "1"), ("accuracy", "f1"), "acc_and_f1"),
    "sts-b": GlueSpec(("sentence1", "sentence2"), "score", None, ("pearson", "spearman"), "pearson_and_spearman"),
    "mnli": GlueSpec(("sentence1", "sentence2"), "gold_label", ("contradiction", "entailment", "neutral"),
                     ("accuracy",), "accuracy"),
    "qnli": GlueSpec(("question", "sentence"), "label", ("entailment", "not_entailment"), ("accuracy",), "accuracy"),
    "rte": GlueSpec(("sentence1", "sentence2"), "label", ("entailment", "not_entailment"), ("accuracy",), "accuracy"),
    "wnli": GlueSpec(("sentence1", "sentence2"), "label", ("0", "1"), ("accuracy",), "accuracy"),
}
_GLUE_ALIASES = {"sst2": "sst-2", "stsb": "sts-b", "sts": "sts-b", "mnli-m": "mnli", "mnli-mm": "mnli"}


def detect_glue(header: list[str], rows: list[list[str]], path: str) -> str:
    """Which GLUE task a TSV holds, from its header (CoLA has none)."""
    cols = {c.strip().lower() for c in header}
    if "gold_label" in cols:
        return "mnli"
    if "is_duplicate" in cols:
        return "qqp"
    if "#1 string" in cols:
        return "mrpc"
    if "score" in cols and "sentence1" in cols:
        return "sts-b"
    if "question" in cols and "sentence" in cols:
        return "qnli"
    if cols >= {"sentence", "label"}:
        return "sst-2"
    if cols >= {"sentence1", "sentence2", "label"}:
        labels = {r[-1].strip() for r in rows if r}
        return "wnli" if labels <= {"0", "1"} else "rte"
    if len(header) == 4 and header[1].strip() in ("0", "1"):
        return "cola"
    raise AttnkitError(f"{path}: cannot tell which GLUE task this TSV is (header: {header}); pass {arg('glue_task')}")


def read_tsv(path: str) -> tuple[list[str], list[list[str]]]:
    """Header and non-empty rows of a task's TSV/CSV."""
    check_data_file(path, "TSV")
    header, rows = read_table(path)
    return header, [r for _, r in rows if r]


def read_stsb(path: str) -> list[tuple[str, str, float]]:
    """(sentence1, sentence2, score) of an STS-B TSV: at least two pairs, scores finite and not all equal."""
    header, rows = read_tsv(path)
    cols = {c.strip().lower(): i for i, c in enumerate(header)}
    missing = [c for c in ("sentence1", "sentence2", "score") if c not in cols]
    if missing:
        raise AttnkitError(f"{path}: STS-B TSV needs columns sentence1, sentence2, score; missing {missing} "
                           f"(header: {header})")
    examples = []
    for n, r in enumerate(rows, start=2):
        try:
            s1, s2, raw = r[cols["sentence1"]], r[cols["sentence2"]], r[cols["score"]]
        except IndexError:
            raise AttnkitError(f"{path}:{n}: malformed row (need sentence1, sentence2 and a numeric "
                               "score)") from None
        examples.append((s1, s2, parse_score(path, n, raw)))
    if len(examples) < 2:
        raise AttnkitError(f"{path}: need at least two scored pairs")
    check_gold_varies(path, [e[2] for e in examples])
    return examples


def read_glue(path: str, subtask: str | None = None) -> tuple[str, list]:
    """The GLUE task of a TSV (`subtask`, or told from its header) and its (text or text pair, label) examples."""
    header, rows = read_tsv(path)
    if subtask is not None:
        subtask = _GLUE_ALIASES.get(subtask.lower(), subtask.lower())
        if subtask not in GLUE:
            raise AttnkitError(f"unknown GLUE task {subtask!r}; use one of {', '.join(GLUE)}")
    subtask = subtask or detect_glue(header, rows, path)
    spec = GLUE[subtask]
    if subtask == "cola":
        rows = [header] + rows  # no header line
        idx = {"text": list(spec.text), "label": spec.label}
    else:
        cols = {c.strip().lower(): i for i, c in enumerate(header)}
        need = list(spec.text) + [spec.label]
        missing = [c for c in need if c not in cols]
        if missing:
            raise AttnkitError(f"{path}: GLUE {subtask} TSV lacks columns {missing} (header: {header})")
        idx = {"text": [cols[c] for c in spec.text], "label": cols[spec.label]}
    examples = []
    for n, r in enumerate(rows, start=1):
        try:
            texts = tuple(r[i] for i in idx["text"])
            raw = r[idx["label"]].strip()
        except IndexError:
            raise AttnkitError(f"{path}: row {n} has too few columns") from None
        if spec.labels is None:
            label = parse_score(path, n, raw)
        else:
            if raw not in spec.labels:
                raise AttnkitError(f"{path}: row {n}: label {raw!r} is not one of {spec.labels}")
            label = raw
        examples.append((texts[0] if len(texts) == 1 else texts, label))
    if not examples:
        raise AttnkitError(f"{path}: no examples")
    if spec.labels is None:
        check_gold_varies(path, [e[1] for e in examples])
    return subtask, examples


def read_squad(path: str) -> tuple[list, bool]:
    """The questions of a SQuAD JSON, (qid, question, context, [answer texts], [answer starts]), and whether it is
    SQuAD 2.0 (unanswerable questions)."""
    check_data_file(path, "SQuAD JSON")
    data = load_json(path, SQUAD_SCHEMA, "SQuAD JSON")  # structure checked: attnkit.run.schemas.SQUAD_SCHEMA
    examples = []
    v2 = str(data.get("version", "")).startswith("v2")
    for art in data["data"]:
        for para in art.get("paragraphs", []):
            ctx = para["context"]
            for qa in para.get("qas", []):
                answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                v2 = v2 or "is_impossible" in qa
                qid = str(qa["id"]) if "id" in qa else f"#{len(examples)}"  # the schema leaves ids optional
                examples.append((qid, qa["question"].lstrip(), ctx,
                                 [a["text"] for a in answers], [int(a["answer_start"]) for a in answers]))
    if not examples:
        raise AttnkitError(f"{path}: no questions")
    return examples, v2


def read_texts(path: str) -> list[str]:
    """Texts of a corpus for masked-LM scoring, read as `attnkit extract` reads corpora (plain text one
    per line; the two texts of a pair count separately); a directory means every .txt file in it."""
    check_data_file(path, "text corpus", folder_ok=True)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".txt"))
        if not files:
            raise AttnkitError(f"{path}: directory holds no .txt files")
        return [t for f in files for t in read_texts(f)]
    segments = read_corpus(path, text_unit="line")
    return [t for seg in segments for t in ((seg,) if isinstance(seg, str) else seg) if t.strip()]

def read_text_data(path: str) -> list[str]:
    """The texts of the mlm and lm tasks (`read_texts`), refused when there are none."""
    texts = read_texts(path)
    if not texts:
        raise AttnkitError(f"{path}: no text")
    return texts


def read_pairs(path: str) -> list[tuple[str, str]]:
    """The (source, target) pairs of the seq2seq task, read as `attnkit extract` reads an encoder–decoder's corpus
    (attnkit.corpus, `pairs=True`: two columns of a TSV/CSV or two fields of JSONL; docs/seq2seq.md)."""
    check_data_file(path, "(source, target) pairs")
    pairs = [tuple(p) for p in open_corpus([path], pairs=True)]
    if not pairs:
        raise AttnkitError(f"{path}: no (source, target) pairs")
    return pairs


# --- activation patching ---------------------------------------------------------------------------------
PATCHING_METRICS = {"stsb": ("cosine",), "mlm": ("logit_diff",), "glue": ("logit_diff",), "lm": ("logit_diff",)}


def read_patching(path: str, kind: str, metric: str | None = None) -> tuple[str, list[dict]]:
    """The metric (`metric`, or the first of task `kind`) and the clean/corrupted examples of a patching TSV/CSV
    (docs/interventions.md, "Patching experiments"): dicts of the needed columns and the file's line."""
    if kind not in PATCHING_METRICS:
        raise AttnkitError(f"patching works with {arg('task_name')} stsb, mlm, glue or lm, not {kind!r}")
    metric = metric or PATCHING_METRICS[kind][0]
    if metric not in PATCHING_METRICS[kind]:
        raise AttnkitError(f"{arg('metric')} {metric!r} does not apply to task {kind}; use "
                           f"{' or '.join(PATCHING_METRICS[kind])}")
    check_data_file(path, "patching TSV or CSV (with a header)")
    header, rows = read_table(path)
    cols = {c.strip().lower(): i for i, c in enumerate(header)}
    need = ["clean", "corrupted"] + (["reference"] if kind == "stsb" else ["target", "foil"])
    missing = [c for c in need if c not in cols]
    if missing:
        raise AttnkitError(f"{path}: patching data needs columns {', '.join(need)}; missing {', '.join(missing)} "
                           f"(header: {header})")
    pair = kind == "glue" and "clean_pair" in cols and "corrupted_pair" in cols
    examples = []
    for line, r in rows:
        try:
            ex = {c: r[cols[c]] for c in need + (["clean_pair", "corrupted_pair"] if pair else [])}
        except IndexError:
            raise AttnkitError(f"{path}:{line}: too few columns") from None
        ex["line"] = line
        examples.append(ex)
    if len(examples) < 2:
        raise AttnkitError(f"{path}: patching needs at least two examples, got {len(examples)}")
    return metric, examples


def read_task_data(task_name: str, path, *, experiment: str | None = None, glue_task: str | None = None,
                   metric: str | None = None):
    """Read and check `attnkit ablate`'s --data as task `task_name` (or, for `experiment` patching, as patching
    pairs for a model of that task) reads it; returns what the reader returns."""
    from .image_data import read_labelled_images

    path = str(path)
    if experiment == "patching":
        return read_patching(path, task_name, metric)
    readers = {"stsb": read_stsb, "glue": lambda p: read_glue(p, glue_task), "squad": read_squad,
               "mlm": read_text_data, "lm": read_text_data, "seq2seq": read_pairs,
               "image-classification": read_labelled_images, "zero-shot-image": read_labelled_images}
    if task_name not in readers:
        raise AttnkitError(f"unknown task {task_name!r}; use one of {', '.join(TASKS)}")
    return readers[task_name](path)


__all__ = ["GLUE", "PATCHING_METRICS", "GlueSpec", "check_data_file", "check_gold_varies", "detect_glue",
           "parse_score", "read_glue", "read_pairs", "read_patching", "read_squad", "read_stsb", "read_task_data",
           "read_text_data", "read_texts", "read_tsv", "subset"]
