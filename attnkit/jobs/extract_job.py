"""`attnkit extract` as a job on a run directory: settings, lock, checkpoints, resume, the finished run.

The command line (attnkit/cli/extract.py) parses options into an `ExtractOptions`; `run_extract_job` does the
rest: refuse bad input before any work, hold the run directory's lock, measure on the chosen engine (one
machine: attnkit/engine/local.py; many machines: attnkit/engine/ray/), checkpoint as it goes, and write the
finished run. It reports through `echo(text, err=False)` (messages name arguments with `attnkit.errors.arg`,
which the command line spells as its options) and never exits the process: an interruption ends in
`Interrupted`, after the checkpoint is saved.

Settings that change the numbers (model, inputs and their content hashes, plan, dtype, backend, device type,
engine) are stored in every checkpoint; a resume continues only under the same settings, explicit or resolved
from defaults (docs/files.md, "meta.json").
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..arch.pruning import removed_heads
from ..engine.devices import parse_devices, replicate
from ..engine.extract import ExtractionState, MaxLogitCollector, kinds_meta, run_extraction
from ..engine.forward import default_batch_size
from ..engine.local import BatchResult, check_workers
from ..engine.openmp import wait_regime
from ..engine.tuning import AUTO
from ..errors import AttnkitError, arg, one_line, print_message
from ..models import (
    attention_modules,
    check_max_length,
    default_model_path,
    load_model,
    max_positions,
    model_dir,
    model_feature_names,
)
from ..ops import backend_label
from ..run.files import FEATURES_FILE, META_FILE, PER_SAMPLE_FILE, PER_SAMPLE_META, PER_SAMPLE_ROWS
from ..run.identity import IDENTITY_FIELD, model_identity
from ..run.locking import output_directory
from ..run.outputs import check_output_path
from ..run.per_sample import PerSampleWriter
from ..run.rundir import RunDir
from ..run.versions import versions
from .job_options import (
    ENGINES,
    ExtractOptions,
    check_extract_options,
    check_model_takes_inputs,
    extract_inputs,
    open_inputs,
    option_settings,
)

# what describes an input's bytes (compared through corpus_sha256 and named when it differs), not how it is read
INPUT_STATE = ("n_segments", "sha256", "size", "mtime")
# a checkpoint at least this often, and after every `checkpoint_every` batches where one is given: by time, a run
# of small batches does not spend its time writing checkpoints, and a kill -9 loses at most this much
CHECKPOINT_SECONDS = 30.0
TRUNCATION_WARN_SHARE = 0.10


class Interrupted(KeyboardInterrupt):
    """The job was interrupted (Ctrl-C, SIGTERM). `saved_after`: the segments the checkpoint it saved holds
    (None: it stopped before the first batch finished, and saved nothing); `signum`: the signal that stopped it
    (SIGINT for Ctrl-C), so a command line can end with the shell's status for it, 128 + signum."""

    def __init__(self, saved_after: int | None, signum: int = signal.SIGINT):
        super().__init__(saved_after)
        self.saved_after = saved_after
        self.signum = int(signum)


def run_extract_job(opts: ExtractOptions, echo: Callable[..., None] = print_message) -> None:
    """Run `attnkit extract` with `opts` (see the module docstring)."""
    check_extract_options(opts)  # what needs no model, also checked by the command line before torch loads
    opts.extract_settings(opts.batch_size).check()  # what every engine checks again, refused before any work
    if opts.workers is not None:
        check_workers(opts.workers)
    run = RunDir(check_output_path(opts.out))
    inputs = extract_inputs(opts)
    # the one write path: the output checked against the inputs, created, then locked before anything else (a
    # second command is told that the directory is in use, whatever it holds); removed again if it was created
    # here and the run never got anywhere
    with output_directory(run.path, "attnkit extract" + (" --engine ray" if opts.engine == "ray" else ""),
                          inputs=inputs):
        if not opts.resume:
            run.check_new(opts.overwrite, opts.per_sample)
        corpus = open_inputs(opts)  # images, or pairs for an encoder–decoder (docs/seq2seq.md)
        corpus.check_has_text()
        check_model_takes_inputs(opts)  # before the model loads
        streams = [s.name for s in corpus.sources if s.is_stream]
        if opts.resume and streams:
            raise AttnkitError(f"cannot resume a run that reads {streams[0]} (a stream cannot be read again to "
                               "check it is the same): save the input to a file and extract from the file")
        job = _RayJob(opts, run, corpus, echo) if opts.engine == "ray" else _LocalJob(opts, run, corpus, echo)
        job.run()


class _Job:
    """What both engines share: the settings a run is resumed under, and writing the finished run."""

    engine = "?"

    def __init__(self, opts: ExtractOptions, run: RunDir, corpus, echo):
        self.opts, self.run_dir, self.corpus, self.echo = opts, run, corpus, echo
        self.devices = parse_devices(opts.devices or opts.device) if opts.engine == "local" else None
        model_name = str(opts.model_path) if opts.model_path else default_model_path()
        self.settings = {
            "model": str(Path(model_name).resolve()) if Path(model_name).exists() else model_name,
            "inputs": [{k: v for k, v in d.items() if k not in INPUT_STATE} for d in corpus.describe()],
            # a stream is hashed as it is read: its fingerprint is recorded when the run finishes
            "corpus_sha256": None if corpus.has_streams else corpus.fingerprint(),
            # how to read the same corpus again (attnkit distances / report use it)
            "reading": {"paths": [s.path if s.is_stream else
                                  getattr(s, "reading_path", None) or str(Path(s.path).resolve())
                                  for s in corpus.sources],
                        "format": opts.fmt, "text_unit": opts.text_unit,
                        "columns": list(opts.columns) if opts.columns else None, "squad_pairs": opts.squad_pairs,
                        **({"images": True} if opts.images else {})},
            **option_settings(opts),  # the settings the options give, also compared before the model loads
            "batch_size": None,  # set by the engine
            "backend": None,
            "device_type": None,
        }

    def say(self, text: str) -> None:
        """A stage message on stderr (unless quiet)."""
        if not self.opts.quiet:
            self.echo(text, err=True)

    def resume_finished(self) -> None:
        """A resume of a finished run has nothing to do (when its settings are these)."""
        meta = self.run_dir.finished_meta()
        self.run_dir.check_settings(meta.get("settings", {}), self.settings, meta.get("inputs"),
                                    self.corpus.describe())
        self.echo(f"{self.opts.out} is already complete; nothing to resume.")

    def finish(self, acc, n_truncated: int, elapsed: float, engine_info: dict, config, *,
               lengths: LengthHistogram | None = None, limit: int | None = None,
               writer: PerSampleWriter | None = None, max_logit: np.ndarray | None = None) -> None:
        """Write features.npz and meta.json (and close the per-sample file), and say what was measured. `config`:
        the model's config (its type, and the heads a pruning removed); `max_logit`: each head's max logit over the
        corpus (`--max-logit`), saved in features.npz."""
        opts, inputs = self.opts, self.corpus.describe()
        model_type, pruned = config.model_type, removed_heads(config)
        if self.settings["corpus_sha256"] is None:  # streams, read to their end now
            self.settings["corpus_sha256"] = self.corpus.fingerprint()
        meta = {
            "status": "complete",
            "model": self.settings["model"],
            "model_type": model_type,
            IDENTITY_FIELD: model_identity(config, opts.model_path),
            "inputs": inputs,
            "corpus": ", ".join(d["path"] for d in inputs),
            "n_segments": acc.n_samples,
            "max_length": opts.max_length,
            "num_windows": opts.num_windows,
            "weighting": opts.weighting,
            "n_truncated": n_truncated,
            "backend": self.settings["backend"],
            **engine_info,
            "settings": self.settings,
            "feature_names": acc.names,
            **({"removed_heads": pruned} if pruned else {}),
            **kinds_meta(config),
            "versions": versions(),
            "elapsed_s": round(elapsed, 3),
        }
        features = acc.result(meta)
        features.max_logit = max_logit
        # Whatever later steps derived (clusters.json, per_sample.npy, ...) describes older features, also when this
        # run was resumed: an interrupted --overwrite resumed ends like an uninterrupted one. Close the per-sample
        # file after, so the replaced run's per_sample.npy goes and this run's stays.
        removed = self.run_dir.finish(features)
        written = [FEATURES_FILE, META_FILE]
        if writer is not None:
            writer.close([d["n_segments"] for d in inputs])
            written += [PER_SAMPLE_FILE, PER_SAMPLE_META] + ([PER_SAMPLE_ROWS] if writer.rows_written else [])
        tok_s = acc.n_tokens / elapsed if elapsed > 0 and not opts.resume else None
        cut = "" if opts.images else f" ({n_truncated} truncated to {opts.max_length} tokens)"  # an image is never cut
        self.echo(f"measured {features.n_samples} {'images' if opts.images else 'samples'}, {features.n_tokens} tokens"
                  f"{cut} in {elapsed:.1f}s"
                  + (f" ({tok_s:,.0f} tokens/s)" if tok_s else "") + f"; wrote {opts.out}/{', '.join(written)}")
        if removed:
            self.echo(removed, err=True)
        share = n_truncated / max(features.n_samples, 1)
        if share > TRUNCATION_WARN_SHARE:
            hint = ""
            q95 = lengths.quantile(0.95) if lengths is not None else None
            if q95:
                hint = (f"; {arg('max_length')} {q95} would cover 95% of segments" if limit is None or q95 <= limit
                        else f"; 95% of segments fit in {q95} tokens, beyond the model's {limit} positions")
            self.echo(f"warning: {share:.0%} of segments were longer than {arg('max_length')} {opts.max_length} "
                      f"and were truncated{hint}", err=True)


class _LocalJob(_Job):
    """This machine's devices, with checkpoints in RUN/checkpoint.npz."""

    def __init__(self, opts, run, corpus, echo):
        super().__init__(opts, run, corpus, echo)
        self.batch_size = opts.batch_size or default_batch_size(self.devices[0])
        self.settings.update(batch_size=self.batch_size, backend=backend_label(opts.backend, self.devices[0]),
                             device_type=self.devices[0].type)
        if opts.max_logit and len(self.devices) > 1:
            raise AttnkitError(f"{arg('max_logit')} is measured on one device only: drop it, or give one device")

    def run(self) -> None:
        opts = self.opts
        model, tokenizer = load_model(opts.model_path, device=self.devices[0], dtype=opts.dtype)
        check_max_length(model, opts.max_length)
        models = replicate(model, self.devices)
        workers = AUTO if opts.workers is None else opts.workers
        threads = AUTO if opts.threads is None else opts.threads
        shape = (len(attention_modules(model)), model.config.num_attention_heads,
                 len(model_feature_names(model, opts.num_windows)))
        state, lengths, max_start = None, None, None
        inputs = self.corpus.describe()
        if opts.resume:
            if not self.run_dir.has_checkpoint() and self.run_dir.is_finished():
                self.resume_finished()
                return
            acc, start, n_truncated, lengths = self.run_dir.load_checkpoint(self.settings, shape, inputs,
                                                                            removed=removed_heads(model.config))
            state = ExtractionState(acc, start, n_truncated)
            if opts.max_logit:  # the settings matched: a --max-logit checkpoint holds its max so far
                max_start = self.run_dir.checkpoint_max_logit(shape[:2])
        # --max-logit: an observer of every forward's q and k; the checkpoint holds its maximum so far (a maximum,
        # not a sum: it accumulates exactly, and what a resume measures again leaves it unchanged)
        collector = MaxLogitCollector(*shape[:2], start=max_start) if opts.max_logit else None
        start = state.next_index if state else 0
        self.say("attnkit extract: " + self.corpus.summary())
        self.say(f"model {model.config.model_type} ({len(attention_modules(model))} layers × "
                 f"{model.config.num_attention_heads} heads), backend {self.settings['backend']}, devices "
                 f"{', '.join(str(next(m.parameters()).device) for m in models)}, batch size {self.batch_size}"
                 + (f"; resuming after segment {start}" if start else ""))
        writer = None
        if opts.per_sample:
            writer = PerSampleWriter(self.run_dir.path, len(attention_modules(model)),
                                     model.config.num_attention_heads, model_feature_names(model, opts.num_windows),
                                     resume_after=start if opts.resume else None)
        checkpoints = Checkpoints(self.run_dir, self.settings, opts.checkpoint_every, LengthHistogram(lengths),
                                  writer, inputs=inputs, max_logit=collector)
        chosen = []

        def on_choice(choice) -> None:  # one line at the start: what the run uses and why (tuning.py)
            chosen.append(choice)
            self.say(choice.line())

        t0 = time.perf_counter()
        with checkpoints.on_interrupt(state):
            state = run_extraction(models[0], tokenizer, self.corpus, opts.extract_settings(self.batch_size),
                                   replicas=models[1:], workers=workers, threads=threads, resume=state,
                                   observers=[collector] if collector is not None else (),
                                   on_batch=checkpoints.after_batch, progress=not opts.quiet, on_choice=on_choice)
        choice = chosen[0]
        self.finish(state.accumulator, state.n_truncated, time.perf_counter() - t0,
                    {"engine": "local", "workers": choice.workers,
                     "devices": [str(next(m.parameters()).device) for m in models],
                     "threads": choice.threads,  # CPU numbers can depend on it (docs/pipeline.md §3)
                     "pipeline": choice.meta(), "waits": wait_regime()},
                    model.config, lengths=checkpoints.lengths, limit=max_positions(model),
                    writer=writer, max_logit=collector.head_max(model) if collector is not None else None)


class _RayJob(_Job):
    """A Ray cluster; resume is by shards (RUN/shards/): a rerun with the same settings, with or without resume,
    measures only the shards that are not finished."""

    def __init__(self, opts, run, corpus, echo):
        super().__init__(opts, run, corpus, echo)
        # the cluster, not this machine, decides the device and (by default) the batch size
        self.settings.update(batch_size=opts.batch_size, backend=opts.backend, device_type="ray cluster")

    def run(self) -> None:
        from transformers import AutoConfig

        from ..engine.ray import run_ray_extraction
        from ..run.shards import remove_shards, shard_dir

        opts, run = self.opts, self.run_dir
        if opts.overwrite:
            remove_shards(run.path)
        elif not opts.resume:
            run.check_new(False)
            if shard_dir(run.path).is_dir() and any(shard_dir(run.path).iterdir()):
                raise AttnkitError(f"{run.path} holds the shards of an unfinished Ray run: continue it with "
                                   f"{arg('resume', True)}, or start over with {arg('overwrite', True)}")
        elif run.is_finished() and not shard_dir(run.path).is_dir():
            self.resume_finished()
            return
        try:  # before any work: the run's meta.json is written from it
            config = AutoConfig.from_pretrained(model_dir(opts.model_path))
        except Exception as exc:
            raise AttnkitError(f"could not read the config of model {str(opts.model_path)!r} on this machine, which "
                               f"writes the run: the model must be here too, at the same path as on the cluster's "
                               f"nodes ({one_line(exc)})") from None
        self.say("attnkit extract (ray): " + self.corpus.summary())
        t0 = time.perf_counter()
        acc, n_truncated, info = run_ray_extraction(
            self.corpus, opts.extract_settings(opts.batch_size), run_dir=run.path, run_settings=self.settings,
            model_path=opts.model_path, dtype=opts.dtype, address=opts.ray_address, progress=not opts.quiet)
        elapsed = time.perf_counter() - t0
        self.finish(acc, n_truncated, elapsed, dict(info, model_type=config.model_type), config)
        remove_shards(run.path)  # their sums are in features.npz now


class LengthHistogram:
    """Token counts of segments before truncation, to suggest a max_length that covers most of them."""

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


class Checkpoints:
    """The local job's checkpoints: every CHECKPOINT_SECONDS, and once `every` batches (forwards) were measured since
    the last one where given (at the end of the planned unit that reaches them: attnkit/engine/plan.py), the
    state is saved to RUN/checkpoint.npz, with the token-length histogram; per-sample rows are flushed to disk
    first, so a checkpoint never counts rows that are not written. On an interruption or an error the last
    state is saved too. `max_logit`: the run's MaxLogitCollector (--max-logit), whose maximum so far each checkpoint
    holds."""

    def __init__(self, run: RunDir, settings: dict, every: int | None, lengths: LengthHistogram,
                 writer: PerSampleWriter | None, inputs: list | None = None, max_logit=None):
        self.run, self.settings, self.every, self.lengths, self.writer = run, settings, every, lengths, writer
        self.inputs = inputs  # each input's path, sha256, size and mtime: a resume names the one that changed
        self.max_logit = max_logit
        self.state: ExtractionState | None = None
        self.forwards = 0  # since the last checkpoint
        self.saved_at = time.monotonic()

    def save(self, state: ExtractionState) -> None:
        if self.writer is not None:
            self.writer.flush()
        self.run.save_checkpoint(state.accumulator, state.next_index, state.n_truncated, self.settings,
                                 lengths=self.lengths.counts, inputs=self.inputs,
                                 max_logit=self.max_logit.result() if self.max_logit is not None else None)
        self.saved_at = time.monotonic()
        self.forwards = 0

    def after_batch(self, state: ExtractionState, res: BatchResult) -> None:
        self.state = state
        if self.writer is not None:
            self.writer.add(res.planned.positions, res.features, res.planned.segments)
        if res.full_lengths is not None:
            self.lengths.add(res.full_lengths)
        self.forwards += res.planned.n_forwards
        if (self.every and self.forwards >= self.every) or time.monotonic() - self.saved_at > CHECKPOINT_SECONDS:
            self.save(state)

    @contextlib.contextmanager
    def on_interrupt(self, start: ExtractionState | None):
        """Around the run: SIGTERM acts as Ctrl-C; an interruption or an AttnkitError saves a checkpoint of what
        was measured since `start` and ends in `Interrupted`, or in the error naming the checkpoint."""
        first = start.next_index if start else 0
        stopped_by = [signal.SIGINT]

        def on_term(signum, frame):
            stopped_by[0] = signum
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        except (KeyboardInterrupt, AttnkitError) as exc:
            saved = self.state is not None and self.state.next_index > first
            if saved:
                self.save(self.state)
            if self.writer is not None:
                self.writer.abandon()
            if isinstance(exc, AttnkitError):
                if saved:
                    raise AttnkitError(f"{exc.template} (checkpoint saved after {self.state.next_index} "
                                       "segments)") from None
                raise
            raise Interrupted(self.state.next_index if saved else None, stopped_by[0]) from None
        finally:
            signal.signal(signal.SIGTERM, old_term)


__all__ = ["ENGINES", "ExtractOptions", "Interrupted", "run_extract_job"]
