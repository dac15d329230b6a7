"""User-facing errors: a message that names the problem, shown by the CLI as one line."""


class AttnkitError(Exception):
    """Bad input or a failed step that the user can fix; the CLI prints it without a traceback."""


def cli_errors(command):
    """Decorate a click command so an AttnkitError ends it with a one-line message and exit status 1."""
    import functools

    import click

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except AttnkitError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper
