"""`attnkit.compare`, the path docs/compare.md names: the comparison lives in `attnkit.engine.compare`."""
from .engine.compare import *  # noqa: F401,F403
from .engine.compare import __all__  # noqa: F401
