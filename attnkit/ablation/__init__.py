"""Ablation experiments through attnkit interventions (Guan et al. 2020, Kovaleva et al. 2019, Michel et al. 2019).

    from attnkit.ablation import get_task, TaskEvaluator, run_experiment
    task = get_task("stsb", "dev.tsv")
    table = run_experiment("heads", model, TaskEvaluator(task, model, tok, limit=300), task.main_metric)

CLI: `attnkit ablate MODEL --task stsb --data dev.tsv --experiment heads` (see `commands.py`).

The names below are imported on first use (they pull in torch); `attnkit.ablation.names` lists the experiments
and tasks without it.
"""
import importlib

from .names import EXPERIMENTS, TASKS

_LAZY = {"ResultTable": "experiments", "Setting": "experiments", "TaskEvaluator": "experiments",
         "run_experiment": "experiments", "run_settings": "experiments", "head_importance": "importance",
         "iterative_pruning": "importance", "get_task": "tasks"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EXPERIMENTS", "TASKS", *sorted(_LAZY)]
