"""`attnkit prune` as a job: remove heads physically and write the smaller model (docs/pruning.md).

The heads come from a list ("L2H5,L3H1", "L4" for a whole layer) or from the file `attnkit ablate --experiment
importance` writes: `--fraction F` removes the first round(F · N) heads (N: all heads of the unpruned model) in
the order that experiment pruned them (Michel et al.'s iterative pruning: its `newly_pruned` column, step by step,
least important first within a step). The model is loaded with its task head (classifier, QA, masked LM) where
its config names one, its heads removed (attnkit/arch/pruning.py), and saved with its tokenizer into a new
directory, which replaces an existing one only with `overwrite` (and only once the new one is written).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..arch.architectures import attention_layers
from ..arch.pruning import prune_heads, pruned_head_grid
from ..errors import AttnkitError, arg
from ..interventions import format_heads, parse_heads
from ..models import default_model_path, load_model, model_dir
from ..run.outputs import ensure_writable_dir, os_errors
from ..run.schemas import IMPORTANCE_SCHEMA, load_json
from .options import PruneOptions, check_out, check_prune_options
from .sizes import count_parameters

IMPORTANCE_FILE = "importance.json"  # what `attnkit ablate --experiment importance -o DIR` writes into DIR
_TASKS = {"ForSequenceClassification": "sequence-classification", "ForQuestionAnswering": "question-answering",
          "ForMaskedLM": "masked-lm", "ForCausalLM": "causal-lm"}


@dataclass
class Pruned:
    """What `run_prune` wrote: the heads removed now, the heads each layer kept, parameters before and after."""

    path: Path
    removed: list
    kept: list = field(default_factory=list)
    params_before: int = 0
    params_after: int = 0


def importance_order(path, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """The heads in the order the importance experiment in `path` (its JSON file, or the directory holding it)
    pruned them; checked against the model's (layers, heads)."""
    path = Path(path)
    if path.is_dir():
        path = path / IMPORTANCE_FILE
    data = load_json(path, IMPORTANCE_SCHEMA, "the table of attnkit ablate --experiment importance")
    grid = data["importance"]
    if (len(grid), len(grid[0]) if grid else 0) != tuple(shape):
        raise AttnkitError(f"{path} ranks {len(grid)} layers × {len(grid[0]) if grid else 0} heads, but the model has "
                           f"{shape[0]} × {shape[1]}")
    order: list[tuple[int, int]] = []
    for i, row in enumerate(data["rows"]):
        try:
            heads = parse_heads(row.get("newly_pruned") or "", shape)
        except AttnkitError as exc:
            raise AttnkitError(f"{path}: rows[{i}].newly_pruned: {exc.template}") from None
        order += [h for h in heads if h not in order]
    return order


def heads_to_remove(opts: PruneOptions, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """The heads `opts` names, in the unpruned numbering."""
    check_prune_options(opts)
    if opts.heads is not None:
        return parse_heads(opts.heads, shape)
    fraction = float(opts.fraction)
    n = shape[0] * shape[1]
    k = round(fraction * n)
    if k == 0:
        raise AttnkitError(f"{arg('fraction')} {fraction:g} of {n} heads rounds to no head")
    order = importance_order(opts.importance, shape)
    if k > len(order):
        raise AttnkitError(f"{opts.importance} orders {len(order)} of the {n} heads, fewer than the {k} that "
                           f"{arg('fraction')} {fraction:g} asks for")
    return order[:k]


def _task_of(path: str) -> str | None:
    """The `task` of attnkit.load_model that keeps the head the config's architecture names."""
    from transformers import AutoConfig

    try:
        archs = AutoConfig.from_pretrained(path).architectures or []
    except Exception:
        return None  # load_model says what is wrong with the directory
    for arch in archs:
        for suffix, task in _TASKS.items():
            if arch.endswith(suffix):
                return task
        if "For" in arch:
            raise AttnkitError(f"{path} holds a {arch}: attnkit prune keeps the heads of encoders, sequence "
                               "classifiers, question answering, masked-LM and causal-LM models")
    return None


def readable_as_umask_says(directory: Path) -> None:
    """Give every file in `directory` the mode a new file gets (0666 less the umask), as attnkit's other files
    have: safetensors writes model.safetensors through a private temporary file, mode 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(directory).rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~umask)


def run_prune(opts: PruneOptions, echo=None) -> Pruned:
    """Prune as `opts` says; `echo(text, err=True)`, when given, receives the stage messages."""
    path = default_model_path() if opts.model == "default" else model_dir(opts.model)  # smollm2: its cached copy
    out = Path(opts.out)
    check_out(out, path, opts.overwrite)
    ensure_writable_dir(out.parent if str(out.parent) else Path("."), "output directory")
    if echo:
        echo(f"attnkit prune: loading {path}", err=True)
    model, tokenizer = load_model(path, device="cpu", task=_task_of(path))
    shape = (len(attention_layers(model, "attnkit prune")), int(model.config.num_attention_heads))
    heads = heads_to_remove(opts, shape)
    if opts.importance is not None:  # heads of the order that an earlier pruning removed are gone already
        has = pruned_head_grid(model)
        heads = [(l, h) for l, h in heads if has[l, h]]
    before = count_parameters(model)
    if echo:
        echo(f"attnkit prune: removing {len(heads)} head(s) and writing {out}", err=True)
    prune_heads(model, heads)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with os_errors(f"write the pruned model to {out}"):
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            readable_as_umask_says(tmp)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)
    grid = pruned_head_grid(model)
    kept = [[int(h) for h in row.nonzero()[0]] for row in grid]
    return Pruned(out, heads, kept, before, count_parameters(model))


def describe(res: Pruned) -> list[str]:
    """What `attnkit prune` prints."""
    n = sum(len(k) for k in res.kept)
    lines = [f"removed {len(res.removed)} head(s): {format_heads(res.removed) or 'none'}",
             "heads per layer now: " + " ".join(str(len(k)) for k in res.kept) + f" ({n} in all)",
             f"parameters: {res.params_before:,} → {res.params_after:,} "
             f"({1 - res.params_after / max(res.params_before, 1):.1%} fewer)",
             f"wrote {res.path} (load it with attnkit.load_model({str(res.path)!r}), or with transformers through "
             f"attnkit.arch.load_pruned_model)"]
    return lines


__all__ = ["IMPORTANCE_FILE", "PruneOptions", "Pruned", "describe", "heads_to_remove",
           "importance_order", "run_prune"]
