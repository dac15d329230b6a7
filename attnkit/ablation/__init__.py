"""Ablation experiments through attnkit interventions (Guan et al. 2020, Kovaleva et al. 2019, Michel et al. 2019).

    from attnkit.ablation import get_task, TaskEvaluator, run_experiment
    task = get_task("stsb", "dev.tsv")
    table = run_experiment("heads", model, TaskEvaluator(task, model, tok, limit=300), task.main_metric)

CLI: `attnkit ablate MODEL --task stsb --data dev.tsv --experiment heads` (see `commands.py`).
"""
from .experiments import EXPERIMENTS, ResultTable, Setting, TaskEvaluator, run_experiment, run_settings
from .importance import head_importance, iterative_pruning
from .tasks import TASKS, get_task

__all__ = ["EXPERIMENTS", "ResultTable", "Setting", "TASKS", "TaskEvaluator", "get_task", "head_importance",
           "iterative_pruning", "run_experiment", "run_settings"]
