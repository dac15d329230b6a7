"""`python -m attnkit.analysis cluster|distances|report|compare ...`"""
from .commands import analysis

analysis(prog_name="python -m attnkit.analysis")
