"""Which versions wrote a file: attnkit's own (from the installed package's metadata) and its main libraries'."""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path


def attnkit_version() -> str:
    """The installed attnkit's version; in a source checkout that is not installed, pyproject.toml's."""
    try:
        return metadata.version("attnkit")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        except OSError:
            found = None
        return found.group(1) if found else "0+unknown"


def versions() -> dict:
    """attnkit, torch, transformers, numpy and python versions (recorded in meta.json)."""
    import numpy
    import torch
    import transformers

    return {"attnkit": attnkit_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__, "python": sys.version.split()[0]}


__all__ = ["attnkit_version", "versions"]
