"""Running a corpus through a model: the plan, the local and Ray engines, collectors, the jobs behind the CLI."""
from .extract import default_batch_size, extract, forward_features, measuring, run_extraction

__all__ = ["default_batch_size", "extract", "forward_features", "measuring", "run_extraction"]
