"""User-facing errors: a message that names the problem, shown by the CLI as one line."""


class AttnkitError(Exception):
    """Bad input or a failed step that the user can fix; the CLI prints it without a traceback."""
