"""`attnkit.per_sample`, the path docs/patterns.md names: the file lives in `attnkit.run.per_sample`."""
from .run.per_sample import *  # noqa: F401,F403
from .run.per_sample import __all__  # noqa: F401
