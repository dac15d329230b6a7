"""`attnkit.compare`, the path docs/compare.md names: the comparison lives in `attnkit.jobs.compare`."""
from .jobs.compare import *  # noqa: F401,F403
from .jobs.compare import __all__  # noqa: F401
