"""The names `attnkit ablate` offers: its experiments and tasks (light, so the command line can list them
without importing torch; the experiments: experiments.py, the tasks: tasks.py)."""

EXPERIMENTS = ("types", "heads", "layers", "importance")
TASKS = ("stsb", "glue", "squad", "mlm")

__all__ = ["EXPERIMENTS", "TASKS"]
