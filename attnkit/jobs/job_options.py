"""What `attnkit extract` and `attnkit distances` take, and the checks of it that need no model: option
combinations, paths, formats and output conflicts. The jobs (extract_job.py, distances_job.py) run them first;
the command line runs them before it imports torch (`preflight_extract`, `preflight_distances`), so that a
refusal comes at once. This module imports nothing heavy (tests/test_cli_startup.py holds it to that)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..embedded import check_model_max_length
from ..engine.ray.session import check_ray_address
from ..errors import AttnkitError, arg, check_int
from ..features import DEFAULT_MAX_LENGTH, DEFAULT_NUM_WINDOWS, DEFAULT_WEIGHTING, DEFAULT_WINDOW, PLAN
from ..run.model_dir import check_model_dir, check_model_takes, model_is_here
from ..run.outputs import check_no_file_in_the_way, check_output_path, check_output_place

ENGINES = ("local", "ray")


@dataclass
class ExtractOptions:
    """Everything `attnkit extract` takes (its options, by their Python names)."""

    paths: list = field(default_factory=list)
    images: bool = False  # `paths` name images (attnkit/corpus/images.py; none: the embedded image set)
    model_path: str | None = None
    fmt: str = "auto"
    text_unit: str = "auto"
    columns: tuple | None = None
    squad_pairs: bool = False
    max_length: int = DEFAULT_MAX_LENGTH
    batch_size: int | None = None
    window: int = DEFAULT_WINDOW
    device: str | None = None
    devices: str | None = None
    dtype: str = "float32"
    num_windows: int = DEFAULT_NUM_WINDOWS
    sentences: bool = False
    limit: int | None = None
    backend: str = "auto"
    workers: int | None = None
    threads: int | None = None
    engine: str = "local"
    ray_address: str | None = None
    out: Path = Path("attnkit-run")
    resume: bool = False
    overwrite: bool = False
    checkpoint_every: int | None = None  # None: by time alone (extract_job.CHECKPOINT_SECONDS)
    quiet: bool = False
    per_sample: bool = False
    weighting: str = DEFAULT_WEIGHTING
    max_logit: bool = False

    def extract_settings(self, batch_size: int | None):
        from ..engine.extract import ExtractSettings

        return ExtractSettings(max_length=self.max_length, batch_size=batch_size, window=self.window,
                               num_windows=self.num_windows, split_sentences=self.sentences, backend=self.backend,
                               weighting=self.weighting)


def option_settings(opts: ExtractOptions) -> dict:
    """The settings of a run (meta.json "settings", what a resume must match) that its options alone give: those
    `preflight_extract` compares before a model loads. batch_size None: the device's default, which the local job
    records once it knows the device. weighting only when not the default (runs made before norm weighting have
    none). max_logit only when asked for (runs without it, and runs made before it existed, have none)."""
    settings = {"limit": opts.limit, "max_length": opts.max_length, "batch_size": opts.batch_size,
                "window": opts.window, "dtype": opts.dtype, "num_windows": opts.num_windows,
                "split_sentences": opts.sentences, "engine": opts.engine, "per_sample": opts.per_sample, "plan": PLAN}
    if opts.weighting != DEFAULT_WEIGHTING:
        settings["weighting"] = opts.weighting
    if opts.max_logit:
        settings["max_logit"] = True
    return settings


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise AttnkitError(f"unknown {arg('engine')} {engine!r}: use local or ray")


def check_extract_options(opts: ExtractOptions) -> None:
    """Refuse options that contradict each other or name nothing, before any work (the job and the command line
    both run this)."""
    if opts.resume and opts.overwrite:
        raise AttnkitError(f"{arg('resume')} and {arg('overwrite')} contradict each other: choose one")
    for name in ("device", "devices", "model_path"):
        if getattr(opts, name) is not None and not str(getattr(opts, name)).strip():
            raise AttnkitError(f"{arg(name)} is empty: leave it out for the default, or name one")
    if opts.device and opts.devices:
        raise AttnkitError(f"give {arg('device')} or {arg('devices')}, not both")
    check_engine(opts.engine)
    if opts.checkpoint_every is not None:
        check_int(opts.checkpoint_every, "checkpoint_every")
    if opts.limit is not None:
        check_int(opts.limit, "limit")
    if opts.threads is not None:
        check_int(opts.threads, "threads")
    if opts.engine == "ray":
        if opts.max_logit:
            raise AttnkitError(f"{arg('max_logit')} is measured by the local engine only (drop {arg('engine')} ray)")
        if opts.per_sample:
            raise AttnkitError(f"{arg('per_sample')} is written by the local engine only (drop {arg('engine')} ray)")
        if opts.workers is not None:
            raise AttnkitError(f"{arg('workers')} sets this machine's tokenisation processes; with "
                               f"{arg('engine', 'ray')} the cluster tokenises in Ray Data tasks")
        if opts.threads is not None:
            raise AttnkitError(f"{arg('threads')} sets this machine's torch threads; with {arg('engine', 'ray')} "
                               "each actor uses the CPUs it holds")
        if opts.device or opts.devices:
            raise AttnkitError(f"{arg('device')}/{arg('devices')} choose devices of this machine; with "
                               f"{arg('engine', 'ray')} every actor uses one GPU of the cluster (or CPUs where it "
                               "has none)")
    check_ray_address(opts.engine, opts.ray_address)
    check_output_path(opts.out)
    if opts.images:
        check_image_options(opts)


def check_image_options(opts: ExtractOptions) -> None:
    """Refuse, with `images`, the options that only say how to read or cut text."""
    text_only = [name for name, given in (("fmt", opts.fmt != "auto"), ("text_unit", opts.text_unit != "auto"),
                                          ("columns", opts.columns), ("squad_pairs", opts.squad_pairs),
                                          ("sentences", opts.sentences)) if given]
    if text_only:
        raise AttnkitError(f"{arg(text_only[0])} says how to read text; with {arg('images')} the inputs are images "
                           "(a datasets directory's image column is named as DIR:COLUMN)")
    if "-" in [str(p) for p in opts.paths]:
        raise AttnkitError(f"{arg('images')} reads image files, not standard input")


def check_model_takes_inputs(opts: ExtractOptions) -> None:
    """Refuse, from config.json before the model loads, images for a text model or text for a vision one, where
    the model is on this machine (a Ray cluster's may be on its nodes alone)."""
    if opts.engine == "local" or model_is_here(opts.model_path):
        check_model_takes(opts.model_path, opts.images)


def open_inputs(opts: ExtractOptions):
    """The corpus `opts` name: images (`images`), or texts opened for the model (read from config.json alone, before
    the model loads; docs/seq2seq.md): an encoder–decoder's as (source, target) pairs, refusing inputs of single
    texts; a decoder-only model's refusing inputs of pairs."""
    from ..corpus import open_corpus
    from ..corpus.images import open_images
    from ..corpus.pairs import check_corpus_for_model, reads_pairs
    from ..embedded import model_config

    if opts.images:
        return open_images(opts.paths or None, limit=opts.limit)
    config = model_config(opts.model_path)
    corpus = open_corpus(opts.paths or None, opts.fmt, text_unit=opts.text_unit, columns=opts.columns,
                         squad_pairs=opts.squad_pairs, limit=opts.limit, pairs=reads_pairs(config))
    check_corpus_for_model(corpus, config)
    return corpus


def extract_inputs(opts: ExtractOptions) -> list:
    """What `attnkit extract` reads, as the write path names them (attnkit.run.outputs.check_output_place)."""
    return [("the model", opts.model_path), *(("a corpus input", p, True) for p in opts.paths or ())]


def preflight_extract(opts: ExtractOptions) -> None:
    """Everything `attnkit extract` can refuse without a model, checked before torch is imported, in the job's
    order: the options, what the output directory already holds (the job checks it again under its lock, and
    says first that another command holds it), the corpus paths and formats (read up to the first text, which
    names a file in a wrong format; standard input is left for the job), and the model directory with
    `max_length` against its positions (local engine: on a Ray cluster it may exist only on the workers)."""
    from ..run.locking import lock_owner
    from ..run.rundir import RunDir

    check_extract_options(opts)
    run = RunDir(check_no_file_in_the_way(opts.out, "run directory"))  # the job's make_run_dir would refuse it
    if lock_owner(run.path) is None:  # in use: the job's lock names the holder first
        if run.path.is_dir() and not opts.resume:
            run.check_new(opts.overwrite, opts.per_sample)
        elif opts.resume and opts.engine == "local":
            run.check_resumable()
            now = option_settings(opts)
            if opts.batch_size is None:  # the default depends on the device: the job compares it
                del now["batch_size"]
            now.setdefault("weighting", None)  # an attention run records none: a norm run's is then named
            now.setdefault("max_logit", None)  # so does a run without max logits
            run.check_resume_settings(now)
    if "-" not in [str(p) for p in opts.paths]:
        open_inputs(opts).check_has_text()
    if opts.engine == "local" and opts.model_path:
        check_model_dir(str(opts.model_path))
    check_model_takes_inputs(opts)
    if opts.engine == "local":
        check_output_place(opts.out, extract_inputs(opts))  # (the job checks it again, under its lock)
        check_model_max_length(opts.model_path, opts.max_length)  # config.json is enough


@dataclass
class DistancesOptions:
    """Everything `attnkit distances` takes (its options, by their Python names)."""

    run: Path
    corpus: Path | None = None
    fmt: str = "auto"
    squad_pairs: bool = False
    columns: tuple | None = None
    limit: int | None = None
    rows_per_sample: int | None = None
    batch_size: int | None = None
    device: str | None = None
    seed: int = 0
    smooth: float = 0.0
    engine: str = "local"
    ray_address: str | None = None
    quiet: bool = False
    overwrite: bool = False


def check_distances_options(opts: DistancesOptions) -> None:
    """Refuse option combinations of `attnkit distances` before any work."""
    check_engine(opts.engine)
    check_ray_address(opts.engine, opts.ray_address)
    if opts.smooth and opts.engine == "ray":
        raise AttnkitError(f"{arg('smooth')} runs on the local engine only (the Ray pipeline sums unsmoothed "
                           "divergences)")


def preflight_distances(opts: DistancesOptions):
    """What `attnkit distances` can refuse without a model, before torch is imported, in the job's order: the
    options, the run directory's files, its corpus (read again and checked to be the bytes it measured), and
    earlier distances that only `overwrite` replaces. Returns (the run as read here, a `Run`; the corpus), for the
    job to use as they are (the run's files are not read again, the corpus's hashes not computed twice), or None
    while another command holds the run (its lock names the holder; the job reads both then)."""
    from ..run.locking import lock_owner
    from ..run.opened import open_run
    from ..run.overwrite import claim_outputs

    check_distances_options(opts)
    if lock_owner(opts.run) is not None:
        return None
    opened = open_run(opts.run)
    texts = distances_inputs(opts, opened.features.meta)
    claim_outputs(distances_outputs(opts.run, opened.features), opts.overwrite)
    return opened, texts


def distances_outputs(run, features) -> list[Path]:
    """The files `attnkit distances` writes into `run` (its `features`, a HeadFeatures): RUN/distances.npz, or one
    RUN/distances_KIND.npz per kind of an encoder–decoder's layers (docs/seq2seq.md §9)."""
    from ..run.distances import distances_file

    kinds = features.kinds or [None]
    return [Path(run) / distances_file(kind) for kind in kinds]


def distances_inputs(opts: DistancesOptions, meta: dict):
    """The inputs `attnkit distances` reads again: an image run's images (`images_of_run`: the same bytes), else
    the run's text corpus or the one `opts.corpus` names (`corpus_of_run`). Options that say how to read text are
    refused for an image run; the Ray engine for an encoder–decoder's run."""
    from ..corpus import corpus_of_run
    from ..corpus.images import images_of_run, is_image_run

    if meta.get("layer_kinds") and opts.engine == "ray":
        raise AttnkitError(f"{opts.run} measured an encoder–decoder, whose distances are measured by the local "
                           f"engine (drop {arg('engine')} ray)")
    if is_image_run(meta):
        given = [name for name, on in (("corpus", opts.corpus is not None), ("fmt", opts.fmt != "auto"),
                                       ("squad_pairs", opts.squad_pairs), ("columns", opts.columns)) if on]
        if given:
            raise AttnkitError(f"{arg(given[0])} says which text to read; {opts.run} measured images, which "
                               "attnkit distances reads again from its meta.json")
        return images_of_run(opts.run, meta, limit=opts.limit or meta.get("n_segments"))
    return corpus_of_run(opts.run, meta, opts.corpus, opts.fmt, squad_pairs=opts.squad_pairs, columns=opts.columns,
                         limit=opts.limit, pairs=bool(meta.get("layer_kinds")))


__all__ = ["ENGINES", "DistancesOptions", "ExtractOptions", "check_distances_options", "check_engine",
           "check_extract_options", "check_image_options", "check_model_takes_inputs", "extract_inputs", "open_inputs",
           "option_settings", "distances_inputs", "preflight_distances", "preflight_extract"]
