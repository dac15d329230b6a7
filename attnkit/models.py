"""Loading models and putting attnkit attention into them.

`instrument(model)` switches a transformers model to `attn_implementation="attnkit"`, runs one tiny
probe forward to learn which modules call the attention interface (and in which order: that order
numbers the layers for models such as DistilBERT whose attention has no `layer_idx`), and attaches a
`Runtime` to them. A model whose attention does not go through the interface is refused by name.
Hooks on the base model record each forward's `input_ids` and `token_type_ids` into the Runtime for
the duration of that forward, so region interventions in a plain `model(**inputs)` find sentences.

An encoder–decoder (BART, Marian, T5, Whisper; docs/seq2seq.md) runs its probe forward on a (source, target) pair;
each attention module gets its kind (encoder, decoder, cross: attnkit/attention/kinds.py), told apart by what its
forward is given (encoder states as `key_value_states`: cross-attention) and by `is_causal`, and attnkit's layer
number: the encoder's layers, then the decoder's self-attention, then its cross-attention (`layer_kinds`).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Sequence

import torch

from .arch.pruning import CONFIG_HEADS, load_pruned_model
from .attention.consumers import observer_consumer
from .attention.context import ModelInputs
from .attention.kinds import CROSS, DECODER, ENCODER, KIND_ATTR, KINDS, LAYER_ATTR, kind_of
from .attention.positions import image_layout
from .attention.runtime import RUNTIME_ATTR, Runtime, recording_callers
from .attention.shared import shared_layers_error
from .embedded import check_model_max_length, embedded_path, is_embedded_name, model_config
from .errors import AttnkitError, arg, one_line
from .features import feature_names
from .hf_attention import NAME, register
from .run.model_dir import (  # checked without torch
    TOKENIZER_FILES,
    check_max_length,
    check_model_dir,
    default_model_path,
    max_positions,  # noqa: F401 (attnkit.models.max_positions: where the engines read it)
    takes_images,
)

log = logging.getLogger("attnkit")

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def model_dir(name_or_path=None) -> str:
    """The local directory of a model named as `load_model` takes it: None for the embedded MiniLM, the name of
    an embedded model (`smollm2`, unless a directory of that name exists here), or a path."""
    if name_or_path is None:
        return default_model_path()
    if is_embedded_name(name_or_path):
        return str(embedded_path(str(name_or_path)))
    return str(name_or_path)


def resolve_device(device=None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise AttnkitError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise AttnkitError(f"device {device!r}: attnkit runs on cpu or cuda (cuda:N)")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise AttnkitError(f"device {device!r} does not exist: the CPU is one device, cpu (or cpu:0)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise AttnkitError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise AttnkitError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def resolve_dtype(dtype=None, device: torch.device | None = None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise AttnkitError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16") from None


def attention_modules(model) -> list:
    """The modules of an instrumented `model` that call attnkit attention, in layer order."""
    mods = getattr(model, "_attnkit_modules", None)
    if mods is not None:
        return mods
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl == NAME:  # loaded with attn_implementation="attnkit": attach the runtime now
        return instrument(model)._attnkit_modules
    if impl is None:
        raise AttnkitError(f"attnkit needs a transformers model, got {type(model).__name__}")
    raise AttnkitError(f"the model runs {impl!r} attention, which attnkit cannot measure or change: load it with "
                       "attn_implementation=\"attnkit\", or call attnkit.instrument(model), which switches it to "
                       "attnkit attention (equal to eager)")


def model_feature_names(model, num_windows: int) -> list[str]:
    """The names of the features an instrumented `model` gives: `feature_names`, with `sink` for a model with a
    learned sink logit per head (gpt-oss), the image features for a vision transformer and the alignment features
    last for an encoder–decoder (docs/features.md)."""
    rt = runtime_of(model)
    return feature_names(num_windows, sink=rt.sink, grid=rt.image is not None, alignment=rt.alignment)


def runtime_of(model) -> Runtime:
    """The Runtime that the attention of an instrumented `model` reads."""
    attention_modules(model)
    return getattr(model, RUNTIME_ATTR)


@contextlib.contextmanager
def observing(model_or_runtime, observers: Sequence[Callable]):
    """Attach `observers` (callables (layer, query, key, lengths, scaling)) to the runtime of a model for the
    block, and always detach them again."""
    rt = model_or_runtime if isinstance(model_or_runtime, Runtime) else runtime_of(model_or_runtime)
    observers = list(observers or ())
    bad = [o for o in observers if not callable(o)]
    if bad:
        raise AttnkitError(f"observers must be callables (layer, query, key, lengths, scaling), got {bad[0]!r}")
    consumers = [rt.attach(observer_consumer(obs)) for obs in observers]  # attnkit/attention/consumers/observers.py
    try:
        with rt.closing_forwards():  # a forward Ctrl-C left open is exited
            yield rt
    finally:
        for consumer in consumers:
            rt.detach(consumer)


_LAST_MODEL: dict[str, str | None] = {"name": None}  # the model attnkit was last given in this session, by name


def _model_name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


def _is_default_model(name: str) -> bool:
    try:
        return os.path.realpath(name) == os.path.realpath(default_model_path())
    except AttnkitError:
        return False


def warn_if_default_is_not_the_last_model(function: str) -> None:
    """Warn (UserWarning) that `function`, given no model, uses the embedded MiniLM while the model last used in
    this session is another one (docs/analysis.md §8): a notebook that loaded SmolLM2 and then asked for maps
    without naming the model gets MiniLM's, which it should hear about."""
    import warnings

    last = _LAST_MODEL["name"]
    if last is not None and not _is_default_model(last):
        warnings.warn(f"{function}: no model given, so the embedded MiniLM, although {last} was loaded in this "
                      "session; pass model=(model, tokenizer) for that model's", UserWarning, stacklevel=4)


def instrument(model, tokenizer=None):
    """Switch `model` to attnkit attention and attach a Runtime. Returns the model.

    `tokenizer` (optional) names the separator tokens by which region interventions find the segments
    of a plain forward without token_type_ids; without it they come from the model's config."""
    register()
    _LAST_MODEL["name"] = _model_name(model)
    if getattr(model, RUNTIME_ATTR, None) is not None and model.config._attn_implementation == NAME:
        if tokenizer is not None:
            getattr(model, RUNTIME_ATTR).separator_ids = _separator_ids(model, tokenizer)
        return model
    cfg = model.config
    mtype = getattr(cfg, "model_type", type(model).__name__)
    seq2seq = bool(getattr(cfg, "is_encoder_decoder", False))
    if seq2seq:
        _check_seq2seq_heads(cfg, mtype)
    elif getattr(cfg, "is_decoder", False):  # an encoder architecture set up as a decoder (BERT with is_decoder=True)
        raise AttnkitError(f"model type {mtype!r} is configured as a decoder (is_decoder=True); attnkit measures "
                           "encoders and the decoder language models of docs/decoders.md")
    image = image_layout(cfg)  # a vision transformer's tokens (attnkit/attention/positions.py); None for text
    try:
        model.set_attn_implementation(NAME)
    except Exception as exc:
        raise AttnkitError(
            f"model type {mtype!r} does not accept custom attention implementations ({exc}); "
            "attnkit supports models whose attention goes through transformers' AttentionInterface "
            "(BERT, RoBERTa, ELECTRA, DistilBERT, Llama, Qwen, Mistral, Gemma, GPT-2, ...)"
        ) from None
    seen = _probe_attention_modules(model, seq2seq, image)
    if not seen:
        raise AttnkitError(
            f"model type {mtype!r} does not route its attention through transformers' AttentionInterface, "
            "so attnkit cannot measure it (supported: BERT, RoBERTa, ELECTRA, DistilBERT and other models "
            "that honour attn_implementation)"
        )
    if seq2seq:
        seen = _number_kinds(seen)
    for i, mod in enumerate(seen):
        if getattr(mod, "layer_idx", None) is None:
            mod.layer_idx = i
    runtime = Runtime(separator_ids=_separator_ids(model, tokenizer),
                      segment_types=(getattr(cfg, "type_vocab_size", None) or 0) > 1, sink=seen.sink, image=image,
                      alignment=seq2seq)
    for mod in seen:
        setattr(mod, RUNTIME_ATTR, runtime)
    _record_inputs(model, runtime)
    model._attnkit_modules = seen
    setattr(model, RUNTIME_ATTR, runtime)
    return model


def _separator_ids(model, tokenizer=None) -> tuple[int, ...]:
    """sep/eos token ids: the tokenizer's when given, else the model config's."""
    source = tokenizer if tokenizer is not None else model.config
    out: list[int] = []
    for name in ("sep_token_id", "eos_token_id"):
        tid = getattr(source, name, None)
        for t in (tid if isinstance(tid, (list, tuple)) else [tid]):
            if isinstance(t, int) and t not in out:
                out.append(t)
    return tuple(out)


def _record_inputs(model, runtime: Runtime) -> None:
    """Hooks on the base model (which every task head calls with the inputs) that begin the forward's context on
    the runtime (`Runtime.enter_forward`: its input_ids and token_type_ids, and what the blocks give it) and end it
    again, also on an exception (a KeyboardInterrupt, which torch's `always_call` hooks do not see, is handled by
    `Runtime.closing_forwards` around attnkit's blocks). The hooks find the runtime on the module, so a deep copy of
    the model records into its own, and instrumenting a model again keeps the hooks it has."""
    base = getattr(model, "base_model", None) or model
    setattr(base, RUNTIME_ATTR, runtime)
    if any(getattr(hook, "_attnkit_hook", False) for hook in base._forward_pre_hooks.values()):
        return
    names = [p.name for p in inspect.signature(base.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def tensor(x):
        return x if isinstance(x, torch.Tensor) else None

    def before(module, args, kwargs):
        given = dict(zip(names, args))
        given.update(kwargs)
        maps = given.get("output_attentions")  # as transformers decides whether to record attentions
        if maps is None:
            maps = getattr(getattr(module, "config", None), "output_attentions", False)
        pixels = tensor(given.get("pixel_values"))
        getattr(module, RUNTIME_ATTR).enter_forward(
            ModelInputs(tensor(given.get("input_ids")), tensor(given.get("token_type_ids")), bool(maps),
                        decoder_mask=tensor(given.get("decoder_attention_mask")),
                        image_size=None if pixels is None else tuple(pixels.shape[-2:])))

    def after(module, args, kwargs, output):
        getattr(module, RUNTIME_ATTR).exit_forward()

    before._attnkit_hook = after._attnkit_hook = True
    base.register_forward_pre_hook(before, with_kwargs=True)
    base.register_forward_hook(after, with_kwargs=True, always_call=True)


def layer_kinds(model) -> list[tuple[str, int]]:
    """(kind, index among the layers of that kind) of each of attnkit's layers of an instrumented `model`, in
    attnkit's order (docs/seq2seq.md): kind "encoder" (self-attention that sees every token), "decoder" (causal
    self-attention) or "cross" (an encoder–decoder's decoder queries over the encoder's keys). A model of one stack
    has one kind: a BERT's layers are [("encoder", 0), ...], a Llama's [("decoder", 0), ...]."""
    counts = dict.fromkeys(KINDS, 0)
    out = []
    for mod in attention_modules(model):
        kind = kind_of(mod) or (DECODER if getattr(mod, "is_causal", False) else ENCODER)
        out.append((kind, counts[kind]))
        counts[kind] += 1
    return out


def _check_seq2seq_heads(cfg, mtype: str) -> None:
    """attnkit's features and interventions are layers × heads: an encoder–decoder's stacks need one head count."""
    heads = {name: getattr(cfg, name) for name in ("encoder_attention_heads", "decoder_attention_heads")
             if isinstance(getattr(cfg, name, None), int)}
    if len(set(heads.values())) > 1:
        raise AttnkitError(f"model type {mtype!r} has {heads['encoder_attention_heads']} heads in its encoder and "
                           f"{heads['decoder_attention_heads']} in its decoder; attnkit measures encoder–decoders "
                           "with one head count in every layer")


def _number_kinds(seen):
    """An encoder–decoder's attention modules (in call order, cross-attention marked by the probe) with their kind and
    attnkit's layer number set (attnkit/attention/kinds.py): the encoder's, then the decoder's self-attention, then
    its cross-attention layers, in that order."""
    for mod in seen:
        if kind_of(mod) is None:
            setattr(mod, KIND_ATTR, DECODER if getattr(mod, "is_causal", False) else ENCODER)
    ordered = type(seen)(m for kind in KINDS for m in seen if kind_of(m) == kind)
    ordered.sink = seen.sink
    for i, mod in enumerate(ordered):
        setattr(mod, LAYER_ATTR, i)
    return ordered


def _probe_inputs(model, seq2seq: bool, device, image=None) -> dict:
    """The probe forward's inputs: two tokens; an encoder–decoder's a source of three tokens (Whisper: silence of
    the length its encoder takes) and a target of two; a vision transformer's (`image` its ImageLayout) one tiny
    random image of the config's size."""
    if image is not None:
        return {"pixel_values": image.probe_pixels(device, next(model.parameters()).dtype)}
    ids = torch.full((1, 2), 1, dtype=torch.long, device=device)
    if not seq2seq:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    cfg = model.config
    if "input_features" in inspect.signature(model.forward).parameters:  # Whisper: log-mel frames
        frames = 2 * int(getattr(cfg, "max_source_positions", 1500))
        source = {"input_features": torch.zeros(1, int(cfg.num_mel_bins), frames, device=device,
                                                dtype=next(model.parameters()).dtype)}
    else:
        src = torch.full((1, 3), 1, dtype=torch.long, device=device)
        source = {"input_ids": src, "attention_mask": torch.ones_like(src)}
    if "decoder_input_ids" not in inspect.signature(model.forward).parameters:  # its encoder alone (T5EncoderModel)
        return source
    start = getattr(cfg, "decoder_start_token_id", None)
    return {**source, "decoder_input_ids": torch.full((1, 2), start if isinstance(start, int) else 0,
                                                      dtype=torch.long, device=device)}


def _mark_cross_attention(model) -> list:
    """Forward pre-hooks on every module of `model` that mark a module as cross-attention (attnkit/attention/kinds.py)
    when its forward is given encoder states as `key_value_states` (BART, Marian, T5, Whisper); returns the hooks'
    handles."""
    def mark(module, args, kwargs):
        if kwargs.get("key_value_states") is not None:
            setattr(module, KIND_ATTR, CROSS)

    return [m.register_forward_pre_hook(mark, with_kwargs=True) for m in model.modules()]


def _probe_attention_modules(model, seq2seq: bool = False, image=None):
    """Run a two-token forward (a vision transformer, `image` its ImageLayout: one tiny random image of the config's
    size) and return the modules that called attnkit attention, in order (a `attnkit.attention.runtime.Callers`,
    which also says whether one has a learned sink logit)."""
    device = next(model.parameters()).device
    hooks = _mark_cross_attention(model) if seq2seq else []
    try:
        with torch.no_grad(), recording_callers() as callers:
            model(**_probe_inputs(model, seq2seq, device, image))
    except AttnkitError:
        raise
    except Exception as exc:
        raise AttnkitError(f"a probe forward of the model failed: {type(exc).__name__}: {exc}") from None
    finally:
        for h in hooks:
            h.remove()
    seen = type(callers)(dict.fromkeys(callers))  # unique, in call order
    if len(seen) < len(callers):  # ALBERT: one shared layer run N times; attnkit numbers layers by module
        mod = next(m for m in seen if callers.count(m) > 1)
        raise shared_layers_error(model, mod, callers.count(mod))
    seen.sink = callers.sink
    return seen


def is_pruned_dir(path: str) -> bool:
    """Whether the model directory `path` holds a model whose heads `attnkit prune` removed (its config.json
    names the heads each layer kept)."""
    import json

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return CONFIG_HEADS in json.load(f)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _no_transformers_bars():
    """Silence transformers' own progress bars (weight loading) for the block: attnkit shows its own."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# what each `task` of load_model needs of a model (its messages)
TASK_NEEDS = {"sequence-classification": "a model with a sequence-classification head",
              "question-answering": "a model with a question-answering head",
              "masked-lm": "masked-language-model loss: an encoder such as BERT, RoBERTa, ELECTRA or DistilBERT",
              "causal-lm": "next-token loss: a decoder language model such as Llama, Qwen or GPT-2",
              "seq2seq-lm": "a target's loss given its source: an encoder–decoder such as BART, Marian or T5",
              "image-classification": "a vision transformer with an image-classification head"}


def load_preprocessor(path: str, vision: bool):
    """What turns inputs into a model's batches: a vision transformer's image processor (transformers'
    AutoImageProcessor; attnkit.tokens.ImageEncoder), else the tokenizer of the model directory `path`."""
    if vision:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(name_or_path=None, *, device=None, dtype=None, task: str | None = None, max_length: int | None = None):
    """Load a model and its tokenizer from a local path (no hub downloads) with attnkit attention.

    `name_or_path=None` loads the embedded MiniLM, `"smollm2"` the embedded decoder SmolLM2-135M-Instruct (the
    optional extra `attnkit[decoders]`; converted once to a cached copy: attnkit.embedded, docs/decoders.md); a
    directory written by `attnkit prune` is loaded with `attnkit.arch.pruning.load_pruned_model` (docs/pruning.md).
    A vision transformer's directory (attnkit.run.model_dir.takes_images) gives its image processor
    (AutoImageProcessor) in the tokenizer's place. `task` picks the head: None (the bare model),
    "sequence-classification", "question-answering", "masked-lm", "causal-lm" (a decoder with its language-model
    head), "seq2seq-lm" (an encoder–decoder with its language-model head), "image-classification" (a vision
    transformer with its classification head). Returns (model, tokenizer),
    the model in eval mode on `device` ("cpu", "cuda"; default: cuda when available).
    A directory without config, weights or tokenizer files, or whose tokenizer knows far fewer tokens
    than the model embeds (a tokenizer built from nothing), is refused with the files it lacks.
    `max_length` (the tokens per input the caller will give it): refused when the model's positions do not
    allow it, from config.json before the model loads (`check_model_max_length`).
    """
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageClassification,
        AutoModelForMaskedLM,
        AutoModelForQuestionAnswering,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    classes = {None: AutoModel, "sequence-classification": AutoModelForSequenceClassification,
               "question-answering": AutoModelForQuestionAnswering, "masked-lm": AutoModelForMaskedLM,
               "causal-lm": AutoModelForCausalLM, "seq2seq-lm": AutoModelForSeq2SeqLM,
               "image-classification": AutoModelForImageClassification}
    if task not in classes:
        raise AttnkitError(f"unknown {arg('task')} {task!r}; use one of {', '.join(str(k) for k in classes)}")
    path = model_dir(name_or_path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_model_dir(path)
    if max_length is not None:
        check_model_max_length(path, max_length)
    vision = takes_images(model_config(path))
    try:
        with _no_transformers_bars():
            tokenizer = load_preprocessor(path, vision)
            if is_pruned_dir(path):  # heads removed by `attnkit prune`: transformers alone cannot load it
                model = load_pruned_model(path, classes[task], dtype=dt)
            else:
                model = classes[task].from_pretrained(path, dtype=dt)
    except AttnkitError:
        raise
    except Exception as exc:
        if task is not None and isinstance(exc, ValueError) and "Unrecognized configuration class" in str(exc):
            mtype = (model_config(path) or {}).get("model_type")
            raise AttnkitError(f"{path!r} holds a {mtype!r} model, for which transformers has no {task} model "
                               f"({TASK_NEEDS[task]})") from None
        raise AttnkitError(f"could not load a model from {path!r}: {one_line(exc)}") from None
    if not vision and not getattr(tokenizer, "is_fast", False):
        raise AttnkitError(f"the tokenizer at {path!r} is not a fast tokenizer; attnkit needs one (tokenizer.json)")
    vocab = None if vision else getattr(model.config, "vocab_size", None)
    if vocab and len(tokenizer) < vocab // 2:
        found = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))]
        raise AttnkitError(f"the tokenizer at {path!r} knows {len(tokenizer)} tokens but the model embeds {vocab}: "
                           f"its tokenizer files ({', '.join(found)}) do not belong to this model")
    if max_length is not None:
        check_max_length(model, max_length)
    model.to(dev).eval()
    instrument(model, None if vision else tokenizer)
    if task == "causal-lm" and not any(getattr(m, "is_causal", False) for m in model._attnkit_modules):
        # transformers gives an encoder a language-model head too, but its rows see the tokens they predict
        raise AttnkitError(f"{path!r} holds a {model.config.model_type!r} model whose attention is not causal: "
                           f"{task} ({TASK_NEEDS[task]}) needs a decoder")
    return model, tokenizer


def given_by_path(model) -> bool:
    """Whether `model`, as a caller passes it, names a model still to load (None: the embedded MiniLM; a local path)
    rather than a loaded model or a (model, tokenizer) pair."""
    return model is None or isinstance(model, (str, bytes)) or hasattr(model, "__fspath__")


def resolve_model(model=None, tokenizer=None, device=None, dtype=None, max_length: int | None = None, *,
                  function: str | None = None):
    """(model, tokenizer), instrumented, from what a caller may pass as a model: None (the embedded MiniLM), a
    local path, a (model, tokenizer) pair, or a model with `tokenizer`. A given model is moved to `device` and
    `dtype` when they are given. `max_length`: as `load_model` checks it (before a model given by its path
    loads). `function`: the public function whose caller gave no model, warned when another model was the last one
    used (`warn_if_default_is_not_the_last_model`)."""
    if model is None and tokenizer is None and function is not None:
        warn_if_default_is_not_the_last_model(function)
    if given_by_path(model):
        return load_model(model, device=device, dtype=dtype, max_length=max_length)
    if isinstance(model, tuple) and len(model) == 2:
        model, tokenizer = model
    if tokenizer is None:
        raise AttnkitError(f"pass the model's tokenizer: a (model, tokenizer) pair, or {arg('tokenizer')}")
    if max_length is not None:
        check_max_length(model, max_length)
    if device is not None:
        model.to(resolve_device(device))
    if dtype is not None:
        model.to(resolve_dtype(dtype))
    instrument(model.eval())
    return model, tokenizer
