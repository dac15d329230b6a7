"""`attnkit extract` as a job on a run directory: settings, lock, checkpoints, resume, the finished run.

The command line (attnkit/cli.py) parses options into an `ExtractOptions`; `run_extract_job` does the rest:
refuse bad input before any work, hold the run directory's lock, measure on the chosen engine (one machine:
attnkit.pipeline; many machines: attnkit.distributed), checkpoint as it goes, and write the finished run.

Settings that change the numbers (model, inputs and their content hashes, plan, dtype, backend, device type,
engine) are stored in every checkpoint; `--resume` continues only under the same settings, explicit or
resolved from defaults.
"""
from __future__ import annotations

import math
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from ..errors import AttnkitError

CHECKPOINT_SECONDS = 120.0  # also checkpoint at least this often, whatever --checkpoint-every says
TRUNCATION_WARN_SHARE = 0.10


@dataclass
class ExtractOptions:
    paths: list = field(default_factory=list)
    model_path: str | None = None
    fmt: str = "auto"
    text_unit: str = "auto"
    columns: tuple | None = None
    squad_pairs: bool = False
    max_length: int = 128
    batch_size: int | None = None
    window: int = 4096
    device: str | None = None
    devices: str | None = None
    dtype: str = "float32"
    num_windows: int = 16
    sentences: bool = False
    limit: int | None = None
    backend: str = "auto"
    workers: int | None = None
    engine: str = "local"
    ray_address: str | None = None
    out: Path = Path("attnkit-run")
    resume: bool = False
    overwrite: bool = False
    checkpoint_every: int = 20
    quiet: bool = False
    per_sample: bool = False


def _say(opts: ExtractOptions, text: str) -> None:
    if not opts.quiet:
        click.echo(text, err=True)


def run_extract_job(opts: ExtractOptions) -> None:
    from ..run.outputs import ensure_writable_dir
    from ..run.rundir import RunDir

    if opts.resume and opts.overwrite:
        raise AttnkitError("--resume and --overwrite contradict each other: choose one")
    if opts.device and opts.devices:
        raise AttnkitError("give --device or --devices, not both")
    if opts.engine not in ("local", "ray"):
        raise AttnkitError(f"unknown engine {opts.engine!r}: use local or ray")
    if opts.ray_address and opts.engine != "ray":
        raise AttnkitError("--ray-address needs --engine ray")
    run = RunDir(opts.out)
    if not opts.resume:
        run.check_new(opts.overwrite)
    created = not run.path.exists()
    ensure_writable_dir(run.path, "run directory")  # before any work: not after an hour of extraction
    try:
        _run_extract_job(opts, run)
    except BaseException:
        if created:  # leave nothing behind for a run that never got anywhere
            _remove_if_only_lock(run.path)
        raise


def _run_extract_job(opts: ExtractOptions, run) -> None:
    from ..corpus import open_corpus
    from .devices import parse_devices
    from ..models import default_model_path

    corpus = open_corpus(opts.paths or None, opts.fmt, text_unit=opts.text_unit, columns=opts.columns,
                         squad_pairs=opts.squad_pairs, limit=opts.limit)
    if opts.resume and any(s.path == "-" for s in corpus.sources):
        raise AttnkitError("cannot resume a run that reads standard input (it cannot be read again to check "
                           "it is the same): save the input to a file and extract from the file")
    devices = parse_devices(opts.devices or opts.device)
    from .extract import default_batch_size
    from ..ops import backend_label

    batch_size = opts.batch_size or default_batch_size(devices[0])
    model_name = str(opts.model_path) if opts.model_path else default_model_path()
    settings = {
        "model": str(Path(model_name).resolve()) if Path(model_name).exists() else model_name,
        "inputs": [{k: v for k, v in d.items() if k not in ("n_segments", "sha256")} for d in corpus.describe()],
        "corpus_sha256": corpus.fingerprint(),
        # how to read the same corpus again (attnkit distances / report use it)
        "reading": {"paths": [src.path if src.path == "-" else str(Path(src.path).resolve()) for src in corpus.sources],
                    "format": opts.fmt, "text_unit": opts.text_unit,
                    "columns": list(opts.columns) if opts.columns else None, "squad_pairs": opts.squad_pairs},
        "limit": opts.limit,
        "max_length": opts.max_length,
        "batch_size": batch_size,
        "window": opts.window,
        "dtype": opts.dtype,
        "num_windows": opts.num_windows,
        "split_sentences": opts.sentences,
        "backend": backend_label(opts.backend, devices[0]),
        "device_type": devices[0].type,
        "engine": opts.engine,
        "per_sample": opts.per_sample,
    }
    if opts.engine == "ray":
        if opts.per_sample:
            raise AttnkitError("--per-sample is written by the local engine only (drop --engine ray)")
        if opts.workers is not None:
            raise AttnkitError("--workers sets this machine's tokenisation processes; with --engine ray the "
                               "cluster tokenises in Ray Data tasks")
        if opts.device or opts.devices:
            raise AttnkitError("--device/--devices choose devices of this machine; with --engine ray every actor "
                               "uses one GPU of the cluster (or CPUs where it has none)")
        # the cluster, not this machine, decides the device and (by default) the batch size
        settings.update(batch_size=opts.batch_size, device_type="ray cluster",
                        backend=opts.backend)
        _run_ray(opts, run, corpus, settings)
        return
    _run_local(opts, run, corpus, settings, devices, batch_size)


def _load_models(opts: ExtractOptions, devices):
    from .devices import replicate
    from .extract import check_max_length
    from ..models import load_model

    model, tokenizer = load_model(opts.model_path, device=devices[0], dtype=opts.dtype)
    check_max_length(model, opts.max_length)
    return replicate(model, devices), tokenizer


def _run_local(opts: ExtractOptions, run, corpus, settings: dict, devices, batch_size: int) -> None:
    from ..run.locking import run_lock
    from .local import default_workers

    models, tokenizer = _load_models(opts, devices)
    model = models[0]
    workers = default_workers(devices[0].type) if opts.workers is None else opts.workers
    with run_lock(run.path, "attnkit extract"):
        acc, start, n_truncated, lengths = None, 0, 0, None
        if opts.resume:
            if not run.has_checkpoint() and run.is_finished():
                run.check_settings(run.finished_settings(), settings)
                click.echo(f"{opts.out} is already complete; nothing to resume.")
                return
            acc, start, n_truncated, lengths = run.load_checkpoint(settings)
        else:
            run.check_new(opts.overwrite)  # again, under the lock: another run may have finished meanwhile
        _say(opts, "attnkit extract: " + corpus.summary())
        _say(opts, f"model {model.config.model_type} ({len(model._attnkit_modules)} layers × "
                   f"{model.config.num_attention_heads} heads), backend {settings['backend']}, devices "
                   f"{', '.join(str(next(m.parameters()).device) for m in models)}, {workers} tokenisation "
                   f"worker(s), batch size {batch_size}" + (f"; resuming after segment {start}" if start else ""))
        _measure_local(opts, run, corpus, settings, models, tokenizer, workers, batch_size, acc, start,
                       n_truncated, lengths)


def _remove_if_only_lock(path: Path) -> None:
    from ..run.locking import LOCK_FILE, OWNER_FILE

    if not path.is_dir():
        return
    left = {p.name for p in path.iterdir()} - {LOCK_FILE, OWNER_FILE}
    if not left:
        shutil.rmtree(path, ignore_errors=True)


class LengthHistogram:
    """Token counts of segments before truncation, to suggest a --max-length that covers most of them."""

    def __init__(self, counts: np.ndarray | None = None):
        self.counts = np.zeros(0, dtype=np.int64) if counts is None else np.asarray(counts, dtype=np.int64)

    def add(self, full_lengths: np.ndarray) -> None:
        c = np.bincount(np.asarray(full_lengths, dtype=np.int64))
        if c.size > self.counts.size:
            c[:self.counts.size] += self.counts
            self.counts = c
        else:
            self.counts[:c.size] += c

    def quantile(self, q: float) -> int | None:
        total = int(self.counts.sum())
        if total == 0:
            return None
        return int(np.searchsorted(np.cumsum(self.counts), math.ceil(q * total)))


def _measure_local(opts, run, corpus, settings, models, tokenizer, workers, batch_size, acc, start, n_truncated,
                   lengths) -> None:
    from .extract import run_extraction

    state = {"acc": acc, "next": start, "trunc": n_truncated, "batches": 0, "saved_at": time.monotonic()}
    hist = LengthHistogram(lengths)
    writer = _per_sample_writer(opts, run, models[0], start) if opts.per_sample else None

    def save_checkpoint(acc_, next_index, trunc):
        if writer is not None:
            writer.flush()  # a checkpoint never counts per-sample rows that are not on disk
        run.save_checkpoint(acc_, next_index, trunc, settings, lengths=hist.counts)
        state["saved_at"] = time.monotonic()

    def on_batch(acc_, next_index, trunc, full_lengths=None):
        state.update(acc=acc_, next=next_index, trunc=n_truncated + trunc)
        if full_lengths is not None:
            hist.add(full_lengths)
        state["batches"] += 1
        if state["batches"] % opts.checkpoint_every == 0 or time.monotonic() - state["saved_at"] > CHECKPOINT_SECONDS:
            save_checkpoint(acc_, next_index, state["trunc"])

    def on_result(res):
        writer.add(res.planned.positions, res.features)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    t0 = time.perf_counter()
    try:
        acc, trunc = run_extraction(
            models[0], tokenizer, corpus, max_length=opts.max_length, batch_size=batch_size,
            num_windows=opts.num_windows, split_sentences=opts.sentences, backend=opts.backend, accumulator=acc,
            start=start, on_batch=on_batch, progress=not opts.quiet, window=opts.window, workers=workers,
            replicas=models[1:], on_result=on_result if writer is not None else None,
        )
    except (KeyboardInterrupt, AttnkitError) as exc:
        saved = state["acc"] is not None and state["next"] > start
        if saved:
            save_checkpoint(state["acc"], state["next"], state["trunc"])
        if writer is not None:
            writer.abandon()
        if isinstance(exc, AttnkitError):
            if saved:
                raise AttnkitError(f"{exc} (checkpoint saved after {state['next']} segments)") from None
            raise
        if saved:
            click.echo(f"\ninterrupted after {state['next']} segments; checkpoint saved. "
                       f"Continue with: attnkit extract ... -o {opts.out} --resume", err=True)
        else:
            click.echo("\ninterrupted before the first batch finished; nothing saved.", err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    elapsed = time.perf_counter() - t0
    _finish(opts, run, corpus, settings, acc, n_truncated + trunc, elapsed, hist,
            {"engine": "local", "workers": workers,
             "devices": [str(next(m.parameters()).device) for m in models]}, models[0], writer)


def _per_sample_writer(opts, run, model, start: int):
    """RUN/per_sample.npy's writer: a new file, or the partial file of the run being resumed."""
    from ..features import feature_names
    from ..run.per_sample import PerSampleWriter

    return PerSampleWriter(run.path, len(model._attnkit_modules), model.config.num_attention_heads,
                           feature_names(opts.num_windows), resume_after=start if opts.resume else None)


def _run_ray(opts: ExtractOptions, run, corpus, settings: dict) -> None:
    """Measure on a Ray cluster. Resume is by shards (RUN/shards/): a rerun with the same settings, with or
    without --resume, measures only the shards that are not finished."""
    from transformers import AutoConfig

    from .ray.driver import remove_shards, run_ray_extraction, shard_dir
    from ..run.locking import run_lock
    from ..models import default_model_path

    with run_lock(run.path, "attnkit extract --engine ray"):
        if opts.overwrite:
            remove_shards(run.path)
        elif not opts.resume:
            run.check_new(False)
            if shard_dir(run.path).is_dir() and any(shard_dir(run.path).iterdir()):
                raise AttnkitError(f"{run.path} holds the shards of an unfinished Ray run: continue it with --resume, "
                                   "or start over with --overwrite")
        elif run.is_finished() and not shard_dir(run.path).is_dir():
            run.check_settings(run.finished_settings(), settings)
            click.echo(f"{opts.out} is already complete; nothing to resume.")
            return
        _say(opts, "attnkit extract (ray): " + corpus.summary())
        t0 = time.perf_counter()
        acc, n_truncated, info = run_ray_extraction(
            corpus, model_path=opts.model_path, dtype=opts.dtype, max_length=opts.max_length,
            batch_size=opts.batch_size, window=opts.window, num_windows=opts.num_windows,
            split_sentences=opts.sentences, backend=opts.backend, run_dir=run.path, settings=settings,
            address=opts.ray_address, progress=not opts.quiet)
        elapsed = time.perf_counter() - t0
        info = dict(info, model_type=AutoConfig.from_pretrained(opts.model_path or default_model_path()).model_type)
        _finish(opts, run, corpus, settings, acc, n_truncated, elapsed, None, info, None)
        remove_shards(run.path)  # their sums are in features.npz now


def _finish(opts, run, corpus, settings, acc, n_truncated, elapsed, hist, engine_info, model, writer=None) -> None:
    from .. import __version__
    from ..models import max_positions

    inputs = corpus.describe()
    meta = {
        "status": "complete",
        "model": settings["model"],
        "model_type": model.config.model_type if model is not None else engine_info.get("model_type"),
        "inputs": inputs,
        "corpus": ", ".join(d["path"] for d in inputs),
        "n_segments": acc.n_samples,
        "max_length": opts.max_length,
        "num_windows": opts.num_windows,
        "n_truncated": n_truncated,
        "backend": settings["backend"],
        **engine_info,
        "settings": settings,
        "feature_names": acc.names,
        "versions": _versions(__version__),
        "elapsed_s": round(elapsed, 3),
    }
    features = acc.result(meta)
    run.finish(features, fresh=not opts.resume)  # (removes a stale per_sample.npy of a replaced run: close after)
    if writer is not None:
        writer.close()
    tok_s = acc.n_tokens / elapsed if elapsed > 0 and not opts.resume else None
    click.echo(f"measured {features.n_samples} samples, {features.n_tokens} tokens "
               f"({n_truncated} truncated to {opts.max_length} tokens) in {elapsed:.1f}s"
               + (f" ({tok_s:,.0f} tokens/s)" if tok_s else "") + f"; wrote {opts.out}/features.npz, meta.json")
    share = n_truncated / max(features.n_samples, 1)
    if share > TRUNCATION_WARN_SHARE:
        hint = ""
        q95 = hist.quantile(0.95) if hist is not None else None
        if q95:
            limit = max_positions(model) if model is not None else None
            hint = (f"; --max-length {q95} would cover 95% of segments" if limit is None or q95 <= limit else
                    f"; 95% of segments fit in {q95} tokens, beyond the model's {limit} positions")
        click.echo(f"warning: {share:.0%} of segments were longer than --max-length {opts.max_length} and were "
                   f"truncated{hint}", err=True)


def _versions(version: str) -> dict:
    import numpy
    import torch
    import transformers

    return {"attnkit": version, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__, "python": sys.version.split()[0]}
