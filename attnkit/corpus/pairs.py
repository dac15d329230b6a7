"""Which inputs a model measures, told from its config alone (the model itself, its config, or config.json as a dict),
so that a mismatch is refused before the model loads (docs/seq2seq.md, "Extracting over pairs"): an encoder–decoder
(`is_encoder_decoder`) measures (source, target) pairs and refuses single texts; a decoder-only model has no pair
format and refuses pairs; an encoder takes either."""
from __future__ import annotations

from ..errors import AttnkitError, arg
from ..run.model_dir import DECODER_TYPES

# encoder–decoders whose encoder reads no text (Whisper: log-mel frames)
AUDIO_TYPES = frozenset({"whisper"})


def _get(config):
    cfg = getattr(config, "config", config)
    if cfg is None:
        return lambda key: None
    return cfg.get if isinstance(cfg, dict) else (lambda key: getattr(cfg, key, None))


def reads_pairs(config) -> bool:
    """Whether the model of `config` measures (source, target) pairs: an encoder–decoder of text (one that reads
    audio is refused by name). None (no config to read yet): False."""
    get = _get(config)
    if not get("is_encoder_decoder"):
        return False
    if get("model_type") in AUDIO_TYPES:
        raise AttnkitError(f"{get('model_type')!r} is an encoder–decoder whose encoder reads audio (log-mel frames): "
                           "attnkit extracts over (source, target) pairs of text only; measure it from Python "
                           "(docs/seq2seq.md)")
    return True


def is_decoder_only(config) -> bool:
    get = _get(config)
    return not get("is_encoder_decoder") and get("model_type") in DECODER_TYPES


def refuse_pairs_for(config, where: str) -> None:
    """A decoder-only model given pairs (`where` names them)."""
    raise AttnkitError(f"{where} gives text pairs, but {_get(config)('model_type')!r} is a decoder-only model, "
                       "which has no pair format: give single texts (one column), or an encoder–decoder for "
                       "(source, target) pairs")


def check_segments_for_model(segments: list, config) -> None:
    """A list of segments (str or (str, str)) against the model of `config`: an encoder–decoder needs pairs, a
    decoder-only model single texts; the first that does not fit is named by its index."""
    if reads_pairs(config):
        for j, s in enumerate(segments):
            if isinstance(s, str):
                raise AttnkitError(f"{arg('texts')}[{j}] is a single text, but {_get(config)('model_type')!r} is an "
                                   "encoder–decoder, which measures (source, target) pairs: give (source, target) "
                                   "tuples")
    elif is_decoder_only(config):
        for j, s in enumerate(segments):
            if not isinstance(s, str):
                refuse_pairs_for(config, f"{arg('texts')}[{j}]")


def check_corpus_for_model(corpus, config) -> None:
    """A corpus opened for the model of `config` (`open_corpus(..., pairs=reads_pairs(config))`, whose sources
    refuse single texts for an encoder–decoder as they plan) against a decoder-only model: an input planned to give
    pairs (two columns, SQuAD pairs) is refused by name. Reads each input's start (its plan), not its text."""
    for source in corpus.sources:
        if source.is_stream:  # read once: planned when the run reads it
            continue
        plan = source.plan()  # an encoder–decoder's corpus refuses an input of single texts here
        if is_decoder_only(config):
            if len(plan.get("columns") or ()) == 2 and not plan.get("pair_optional") or plan.get("squad_pairs"):
                refuse_pairs_for(config, source.name)
