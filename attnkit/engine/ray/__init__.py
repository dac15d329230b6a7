"""The Ray Data engine."""
from .driver import *  # noqa: F401,F403
