"""`python -m attnkit.cli ...`: the `attnkit` command."""
from .main import main

main()
