"""The names `attnkit ablate` offers: its experiments, tasks and default resamples (light, so the command line
can list them without importing torch; the experiments: experiments.py, the tasks: tasks.py)."""

EXPERIMENTS = ("types", "heads", "layers", "importance", "patching")
TASKS = ("stsb", "glue", "squad", "mlm", "lm")
N_BOOT = 10_000  # bootstrap resamples by default (`--resamples`; metrics.py)

__all__ = ["EXPERIMENTS", "N_BOOT", "TASKS"]
