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
from ..arch.pruning import n_attnkit_layers, prune_heads, pruned_head_grid
from ..errors import AttnkitError, arg
from ..interventions import format_heads, parse_heads
from ..models import default_model_path, load_model, model_dir
from ..run.locking import output_directory
from ..run.outputs import check_output_path, describe_os_error
from ..run.schemas import IMPORTANCE_SCHEMA, load_json
from .options import PruneOptions, check_out, check_prune_options, prune_inputs
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


def _config_of(path: str):
    """The transformers config of the model at `path`, or None (load_model then says what is wrong with it)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception:
        return None


def _task_of(config, path: str) -> str | None:
    """The `task` of attnkit.load_model that keeps the head the config's architecture names (an encoder–decoder's
    language-model head: BART's and T5's …ForConditionalGeneration, Marian's MarianMTModel)."""
    archs = (getattr(config, "architectures", None) or []) if config is not None else []
    if getattr(config, "is_encoder_decoder", False) and any(a.endswith(("ForConditionalGeneration", "MTModel"))
                                                           for a in archs):
        return "seq2seq-lm"
    for arch in archs:
        for suffix, task in _TASKS.items():
            if arch.endswith(suffix):
                return task
        if "For" in arch:
            raise AttnkitError(f"{path} holds a {arch}: attnkit prune keeps the heads of encoders, sequence "
                               "classifiers, question answering, masked-LM, causal-LM and encoder–decoder "
                               "(conditional generation) models")
    return None


def readable_as_umask_says(directory: Path) -> None:
    """Give every file in `directory` the mode a new file gets (0666 less the umask), as attnkit's other files
    have: safetensors writes model.safetensors through a private temporary file, mode 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(directory).rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~umask)


def _shape_of(config) -> tuple[int, int] | None:
    """(layers, heads) of attnkit's numbering that the config records (unpruned numbering), or None."""
    try:
        return n_attnkit_layers(config), int(config.num_attention_heads)
    except (AttributeError, TypeError, ValueError):
        return None


def _replace(out: Path, write) -> None:
    """Write the new model with `write(directory)` into a directory beside `out`, then rename it into place (the
    old `out`, moved aside first, is removed only once the new one is there); whatever fails, nothing partial is
    left and the old `out` stays."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    try:
        write(tmp)
        os.replace(out, old)  # `out` exists: run_prune created or locked it
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old)
    except OSError as exc:
        raise AttnkitError(f"could not write the pruned model to {out}: {describe_os_error(exc)}") from None
    except AttnkitError:
        raise
    except Exception as exc:  # safetensors and tokenizers raise their own errors for a full disk
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise AttnkitError(f"could not write the pruned model to {out}: {reason}") from None
    finally:
        for leftover in (tmp, old):
            with contextlib.suppress(OSError):
                shutil.rmtree(leftover)


def run_prune(opts: PruneOptions, echo=None) -> Pruned:
    """Prune as `opts` says; `echo(text, err=True)`, when given, receives the stage messages. Everything that can
    be checked is checked before the model loads and before anything is written; the output is written through
    the one write path (attnkit.run.locking.output_directory): never the model, the importance file, the working
    directory or a directory holding one of them, locked while it is written, replaced only once the new model is
    complete."""
    path = default_model_path() if opts.model == "default" else model_dir(opts.model)  # smollm2: its cached copy
    check_output_path(opts.out)
    check_prune_options(opts)
    out = Path(opts.out)
    config = _config_of(path)
    task = _task_of(config, path)
    shape = _shape_of(config)
    if shape is not None:
        heads_to_remove(opts, shape)  # a bad --heads or --fraction is heard of before the model loads
    inputs = prune_inputs(opts, path)
    with output_directory(out, "attnkit prune", inputs=inputs, whole=True):
        check_out(out, path, opts.overwrite)
        if echo:
            echo(f"attnkit prune: loading {path}", err=True)
        model, tokenizer = load_model(path, device="cpu", task=task)
        shape = (len(attention_layers(model, "attnkit prune")), int(model.config.num_attention_heads))
        heads = heads_to_remove(opts, shape)
        if opts.importance is not None:  # heads of the order that an earlier pruning removed are gone already
            has = pruned_head_grid(model)
            heads = [(l, h) for l, h in heads if has[l, h]]
        before = count_parameters(model)
        if echo:
            echo(f"attnkit prune: removing {len(heads)} head(s) and writing {out}", err=True)
        prune_heads(model, heads)

        def write(directory: Path) -> None:
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            readable_as_umask_says(directory)

        _replace(out, write)
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
