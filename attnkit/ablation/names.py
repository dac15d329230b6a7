"""The names `attnkit ablate` offers: its experiments, tasks and default resamples (light, so the command line
can list them without importing torch; the experiments: experiments.py, the tasks: tasks.py)."""
from ..features import DEFAULT_MAX_LENGTH

EXPERIMENTS = ("types", "heads", "layers", "importance", "patching", "best_head")
TASKS = ("stsb", "glue", "squad", "mlm", "lm", "seq2seq", "image-classification", "zero-shot-image")
PAIR_TASKS = ("seq2seq",)  # the tasks of an encoder–decoder, which read (source, target) pairs
IMAGE_TASKS = ("image-classification", "zero-shot-image")  # the tasks that read labelled images
N_BOOT = 10_000  # bootstrap resamples by default (`--resamples`; metrics.py)
SQUAD_MAX_LENGTH, SQUAD_STRIDE = 384, 128  # SQuAD's windows over long contexts, and their overlap


def task_max_length(task_name: str, max_length: int | None = None) -> int:
    """The tokens per input of a task: `max_length` when given, else the task's default (squad 384, else 128)."""
    if max_length is not None:
        return max_length
    return SQUAD_MAX_LENGTH if task_name == "squad" else DEFAULT_MAX_LENGTH


__all__ = ["EXPERIMENTS", "IMAGE_TASKS", "N_BOOT", "PAIR_TASKS", "SQUAD_MAX_LENGTH", "SQUAD_STRIDE", "TASKS",
           "task_max_length"]
