"""What every `attnkit` command shares: the options that more than one command takes (one help text each), the
one --columns parser, the one RUN path type, and how library errors and messages reach the user.

The library names the arguments it refuses by their Python names (attnkit.errors.arg); `cli_errors` and
`echo_for` spell them as the running command's options (`max_length` → `--max-length`), so a user of the
command line reads about flags and a user of Python about arguments.
"""
from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import importlib.util
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import click

from ..corpus import FORMATS, check_columns
from ..errors import INT_RANGES, AttnkitError, spell
from ..features import DEFAULT_MAX_LENGTH, DEFAULT_NUM_WINDOWS


def int_range(name: str) -> click.IntRange:
    """The click type of integer option `name` (its Python name): the library's range for it
    (attnkit.errors.INT_RANGES), so the command line and Python refuse the same values."""
    lo, hi = INT_RANGES[name]
    return click.IntRange(lo, hi)


class OutputPath(click.Path):
    """A path to write to (-o, --json): like click.Path, but an empty one is refused (it would silently mean
    the current directory), and so is, for a directory (`file_okay=False`), any existing path that is not one:
    click refuses a regular file only, and /dev/null, a pipe or a socket would fail later as an error of the run
    instead of a usage error (exit 2)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("the path is empty", param, ctx)
        if not self.file_okay and os.path.exists(value) and not os.path.isdir(value):
            self.fail(f"{os.fsdecode(value)!r} exists and is not a directory", param, ctx)
        return super().convert(value, param, ctx)


RUN = click.Path(exists=True, file_okay=False, path_type=Path)  # an existing run directory
SEED = int_range("seed")  # what scikit-learn accepts as random_state
DTYPES = ("float32", "float16", "bfloat16")
BACKEND_CHOICES = ("auto", "fused", "reference")
ENGINE_CHOICES = ("local", "ray")


# --- how library messages name arguments on the command line ---------------------------------------------
def option_names(command: click.Command | None = None) -> dict[str, str]:
    """Python argument → how `command` (default: the running one) spells it: its long option, else its
    short one; an argument in capitals."""
    if command is None:
        ctx = click.get_current_context(silent=True)
        command = ctx.command if ctx is not None else None
    names: dict[str, str] = {}
    for p in command.params if command is not None else ():
        if isinstance(p, click.Option):
            longs = [o for o in p.opts if o.startswith("--")]
            names[p.name] = longs[0] if longs else p.opts[0]
        elif isinstance(p, click.Argument):
            names[p.name] = p.name.upper()
    return names


def echo_for(command: click.Command | None = None):
    """An `echo(text, err=False)` for the jobs behind the command line: their messages with the arguments they
    name spelled as the command's options."""
    names = option_names(command)

    def echo(text: str, err: bool = False) -> None:
        click.echo(spell(text, names), err=err)

    return echo


def cli_errors(command):
    """Decorate a click command so an AttnkitError ends it with a one-line message (arguments spelled as the
    command's options) and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except AttnkitError as exc:
            raise click.ClickException(exc.message(option_names())) from None

    return wrapper


class OneLineUsageError(click.UsageError):
    """A usage error shown as one line, "Error: <problem> (see 'attnkit extract --help')", instead of click's
    usage block: every refusal of the command line is one line on stderr, with exit status 2."""

    def show(self, file=None) -> None:
        where = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"Error: {self.format_message()}{where}", file=file, err=file is None)


@contextlib.contextmanager
def _one_line_usage():
    try:
        yield
    except OneLineUsageError:
        raise
    except click.UsageError as exc:  # BadParameter, NoSuchOption, MissingParameter, ...
        raise OneLineUsageError(" ".join(exc.format_message().split()), exc.ctx) from None


NEGATIVE_NUMBER = re.compile(r"-\.?\d")


def _shield_negative_values(command: click.Command | None, args: list[str]) -> list[str]:
    """`args` with a negative number given to an option whose value may be left out (`--smooth -0.1`,
    `--smooth=-0.1`) prefixed by a space: click would read it as an unknown option `-0` instead of refusing
    the value; with the space the number still converts and its range check names the problem."""
    if command is None:
        return args
    optional = {o for p in command.params if isinstance(p, click.Option) and getattr(p, "_flag_needs_value", False)
                for o in p.opts}
    out: list[str] = []
    for arg in args:
        name, eq, value = arg.partition("=")
        if eq and name in optional and NEGATIVE_NUMBER.match(value):
            arg = f"{name}= {value}"
        elif out and out[-1] in optional and NEGATIVE_NUMBER.match(arg):
            arg = f" {arg}"
        out.append(arg)
    return out


ARGV = "attnkit.argv"  # ctx.meta key: the arguments the command line was given, as given
PROGRESS_EVERY_S = 30.0  # at most one progress line per bar this often on a stderr that is no terminal


class ProgressLines:
    """stderr when it is a file or a pipe, not a terminal: a progress bar's frames (tqdm redraws its line in
    place, "\r" + the bar, many times a second) become whole lines, one when a bar starts, then at most one per
    `every` seconds, and the last one when it ends, instead of thousands of "\r" frames in a log. Everything
    else passes through as written."""

    def __init__(self, stream, every: float = PROGRESS_EVERY_S, clock=time.monotonic):
        self._stream, self._every, self._clock = stream, every, clock
        self._pending: str | None = None  # the latest frame, not written yet
        self._last: float | None = None  # when the bar under way last wrote a line; None: no bar under way

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # a text stream, as the one it wraps (click probes with bytes)
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        head, *frames = text.replace("\x1b[A", "").split("\r")  # cursor-up: nested bars, meaningless here
        if head:
            bar_end = self._last is not None and not head.strip("\n")  # the newline a bar ends with
            self.end_bar()
            if not bar_end:
                self._stream.write(head)
        for frame in frames:
            frame = frame.rstrip()
            if not frame:  # a bar cleared at its end
                self.end_bar()
            elif self._last is None or self._clock() - self._last >= self._every:
                self._stream.write(frame + "\n")
                self._last, self._pending = self._clock(), None
            else:
                self._pending = frame
        return len(text)

    def end_bar(self) -> None:
        """Write the bar's last frame, if not written yet: the line a log ends the bar with."""
        if self._pending is not None:
            self._stream.write(self._pending + "\n")
        self._pending = self._last = None

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # encoding, errors, fileno, ...: the stream's
        return getattr(self._stream, name)


@contextlib.contextmanager
def progress_as_lines():
    """While the block runs, progress bars written to a stderr that is not a terminal are `ProgressLines`."""
    stderr = sys.stderr
    is_tty = getattr(stderr, "isatty", lambda: False)
    if stderr is None or isinstance(stderr, ProgressLines) or is_tty():
        yield
        return
    sys.stderr = lines = ProgressLines(stderr)
    try:
        yield
    finally:
        lines.end_bar()
        sys.stderr = stderr


class CommandLine(click.Group):
    """The `attnkit` group: its own and its commands' usage errors are one line (OneLineUsageError); Ctrl-C ends
    any command with the shell's status for SIGINT, 130 (click would print "Aborted!" and exit 1), also during
    start-up, before a command's own interruption handling runs; progress on a stderr that is no terminal is a
    line now and then (`ProgressLines`); the arguments as given are kept for `command_line`."""

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)
        with _one_line_usage():
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta[ARGV] = given
        return ctx

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        return name, command, _shield_negative_values(command, rest)

    def invoke(self, ctx):
        try:
            with _one_line_usage(), progress_as_lines():
                return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # a job that turned SIGTERM into one says so (its signum)
            click.echo("\ninterrupted.", err=True)
            sys.exit(128 + int(getattr(exc, "signum", signal.SIGINT)))


def command_line(add: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> str | None:
    """The running command as the user typed it (program name and arguments, shell-quoted), without the flags in
    `drop` and with those in `add` appended when absent: a command to copy and run again. None outside the
    `attnkit` command group."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    given = root.meta.get(ARGV) if root is not None else None
    if given is None:
        return None
    args = [a for a in given if a not in drop]
    args += [a for a in add if a not in args]
    program = (root.info_name or "attnkit").split()  # "python -m attnkit.cli" when run so: three words
    return shlex.join([*program, *args])


# --- the one --columns parser --------------------------------------------------------------------------------
def parse_columns(ctx, param, value):
    """click callback of --columns: "COL" or "COL,COL2" → a tuple, refusing an empty name (usage error)."""
    if value is None:
        return None
    try:
        return check_columns(value)
    except AttnkitError as exc:
        raise click.BadParameter(exc.message({"columns": "--columns"}), ctx=ctx, param=param) from None


# --- options that several commands take ----------------------------------------------------------------------
def run_argument(name: str = "run"):
    return click.argument(name, type=RUN)


def quiet_option(fn):
    return click.option("-q", "--quiet", is_flag=True,
                        help="No progress bars or stage messages on stderr (results are still printed).")(fn)


def corpus_format_option(fn):
    return click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="auto", show_default=True,
                        help="Corpus format; auto goes by extension (.txt .jsonl .json .tsv .csv .parquet, also "
                             ".gz/.zst) and recognises datasets saved with save_to_disk. Needed for '-' (standard "
                             "input) unless it is text.")(fn)


def columns_option(fn):
    return click.option("--columns", default=None, metavar="COL[,COL2]", callback=parse_columns,
                        help="TSV/CSV/Parquet/datasets/JSONL: the text column, and optionally the pair column "
                             "(default: guessed, e.g. sentence1,sentence2).")(fn)


def squad_pairs_option(fn):
    return click.option("--squad-pairs", is_flag=True,
                        help="SQuAD JSON: measure (question, context) pairs instead of contexts.")(fn)


def limit_option(fn):
    return click.option("--limit", default=None, type=int_range("limit"),
                        help="Use only the first N segments (texts, sentences or examples) of the input.")(fn)


def model_option(fn):
    return click.option("--model", "model_path", default=None, metavar="PATH",
                        help="Local model directory (transformers format), or smollm2: the embedded decoder "
                             "SmolLM2-135M-Instruct (its install: docs/decoders.md). Default: the embedded MiniLM "
                             "(6 layers × 12 heads).")(fn)


MAX_LENGTH_HELP = ("Tokens per sample, special tokens included; longer segments are truncated (and counted). At "
                   "most the model's positions.")


def max_length_option(fn=None, *, default_note: str | None = None):
    """--max-length; `default_note` (with no default value): what a command without one of its own does."""
    if default_note is not None:
        return click.option("--max-length", default=None, type=int_range("max_length"),
                            help=f"{MAX_LENGTH_HELP} [default: {default_note}]")
    return click.option("--max-length", default=DEFAULT_MAX_LENGTH, show_default=True,
                        type=int_range("max_length"), help=MAX_LENGTH_HELP)(fn)


def batch_size_option(default: int | None = None):
    help_ = "Samples per batch" + (" [default: 16 CPU, 64 GPU]." if default is None else ".")
    return click.option("--batch-size", default=default, show_default=default is not None,
                        type=int_range("batch_size"), help=help_)


def torch_cuda_build() -> tuple[str, bool] | None:
    """(torch's version, whether it is built for GPUs: CUDA, or ROCm, which torch.cuda drives too), read from the
    installed torch's version.py without importing torch, whose start-up is what the check spares a refused
    command; None when it cannot be read."""
    spec = importlib.util.find_spec("torch")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    try:
        tree = ast.parse((Path(folders[0]) / "version.py").read_text())
    except (IndexError, OSError, SyntaxError, ValueError):
        return None
    values = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    if "__version__" not in values or "cuda" not in values:
        return None
    return str(values["__version__"]), values["cuda"] is not None or values.get("hip") is not None


def cuda_missing() -> str | None:
    """Why CUDA cannot be available on this machine, found without importing torch: the installed torch is built
    without it, or (a CUDA build) no NVIDIA driver library loads. None when it may be available (torch decides)."""
    build = torch_cuda_build()
    if build is None:
        return None
    version, gpu = build
    if not gpu:
        return f"torch {version} is built without CUDA"
    if "+rocm" in version:
        return None
    try:
        ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")  # loading it starts nothing on a GPU
    except OSError:
        return "no NVIDIA driver is installed (libcuda does not load)"
    return None


CUDA_NAME = re.compile(r"\s*cuda(:\d+)?\s*")


def check_devices(ctx, param, value):
    """click callback of --device and --devices: a CUDA device on a machine where CUDA cannot be available is
    refused now (exit status 1), before the command imports torch and loads its model; everything else is checked
    by the library once torch is there (attnkit.models.resolve_device)."""
    if value is None:
        return value
    asked = [part for part in str(value).split(",") if CUDA_NAME.fullmatch(part)]
    why = cuda_missing() if asked else None
    if why is not None:
        raise click.ClickException(f"device {asked[0].strip()!r} requested but CUDA is not available on this machine: "
                                   f"{why}")
    return value


def device_option(fn):
    return click.option("--device", default=None, callback=check_devices,
                        help="cpu, cuda or cuda:N [default: cuda if available].")(fn)


def dtype_option(fn):
    return click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
                        help="Dtype of the model's weights.")(fn)


def backend_option(fn):
    return click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True,
                        help="fused: the compiled op; reference: pure PyTorch; auto: fused when built.")(fn)


def num_windows_option(fn):
    return click.option("--num-windows", default=DEFAULT_NUM_WINDOWS, show_default=True,
                        type=int_range("num_windows"),
                        help="Distance windows of the distance feature (Guan et al.).")(fn)


def sentences_option(fn):
    return click.option("--sentences", is_flag=True,
                        help="Also split segments into sentences after . ! ? (for intra/inter).")(fn)


def engine_option(fn):
    return click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="local", show_default=True,
                        help="local: this machine's devices; ray: a Ray Data pipeline over a Ray cluster (pip "
                             "install 'attnkit[distributed]'), resumable by shards.")(fn)


def ray_address_option(fn):
    return click.option("--ray-address", default=None, metavar="ADDR",
                        help="Ray cluster to join (e.g. auto, or ray://head:10001) [default: start a local "
                             "one].")(fn)


def overwrite_option(fn):
    return click.option("--overwrite", is_flag=True,
                        help="Replace earlier results of this command where it writes (refused without it; the "
                             "report drawn from them goes too, and the command says what it removed).")(fn)


def svg_option(fn):
    return click.option("--svg/--no-svg", default=True, show_default=True, help="Also save every figure as SVG.")(fn)


# the shared options by name, for `shared`
SHARED = {"model": model_option, "format": corpus_format_option, "columns": columns_option,
          "squad-pairs": squad_pairs_option, "limit": limit_option, "max-length": max_length_option,
          "batch-size": batch_size_option(), "device": device_option, "dtype": dtype_option, "backend": backend_option,
          "num-windows": num_windows_option, "sentences": sentences_option, "engine": engine_option,
          "ray-address": ray_address_option, "svg": svg_option, "quiet": quiet_option,
          "overwrite": overwrite_option}


def shared(*names, **defaults):
    """Add the shared options `names` (keys of SHARED, in --help order) to a command; `defaults` gives another
    default where a command has one (`batch_size=16`; `max_length="..."`: none, what the command does instead)."""
    decorators = [batch_size_option(defaults["batch_size"]) if name == "batch-size" and "batch_size" in defaults
                  else max_length_option(default_note=defaults["max_length"])
                  if name == "max-length" and "max_length" in defaults else SHARED[name] for name in names]

    def deco(fn):
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return deco


__all__ = ["ARGV", "RUN", "SEED", "SHARED", "CommandLine", "command_line", "OneLineUsageError", "OutputPath",
           "ProgressLines", "progress_as_lines",
           "cli_errors", "echo_for", "int_range", "option_names", "parse_columns", "run_argument", "shared"]
