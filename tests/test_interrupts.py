"""Ctrl-C anywhere in attnkit leaves the model as it was (issues 46, 47; docs/interventions.md, "Blocks, threads and
interruptions"). For each way attnkit runs a model — extract, head means, detect-heads, an ablation sweep, `track`,
`intervene` (with given sentence ids), `cache_heads`, `generate` under an intervention, a transformers Trainer with
`AttnkitCallback` — a forward hook on one transformer layer raises KeyboardInterrupt on its n-th call, as Ctrl-C
would mid-forward (deterministic: no signal, no clock). Afterwards attnkit holds nothing on the model (`held`: no
intervention, cache, sentence ids, tracker or observer, no per-forward state in its runtime, no hook or replaced
forward, no change to the process still held: `attnkit.process_changes()`), and the same call, then a plain forward, give exactly the numbers of a
deep copy of the model made before the interruption.

The embedded MiniLM for the encoder cases, a tiny random Llama (tests/synthetic.py) for the decoder ones."""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import numpy as np
import pytest
import torch

import attnkit
from attnkit.caching import encoder_layers
from attnkit.interventions import Intervention, open_blocks
from attnkit.models import runtime_of

from .conftest import SENTENCES
from .synthetic import tiny_decoder

DECODER_TEXTS = ["the cat sat on the mat", "bread needs time"]  # words of the decoder tokenizer (tests/conftest.py)
# Runtime fields that describe the model rather than what runs on it (set when it is instrumented)
MODEL_FIELDS = {"separator_ids", "sink", "segment_types"}


def _at_rest(value, rest) -> bool:
    if value is rest:
        return True
    if isinstance(value, torch.Tensor) or isinstance(rest, torch.Tensor):
        return False
    if isinstance(value, (list, dict, tuple, set)):
        return len(value) == 0 and len(rest) == 0
    try:
        return bool(value == rest)
    except Exception:  # an object that does not compare: held
        return False


def held(model) -> dict[str, object]:
    """What attnkit holds on `model` beyond an idle model, by name (empty: nothing): every field of its runtime that
    differs from the Runtime's default (what a block or a forward puts there: what is given to the next forwards
    (intervention, sentences, batch), the consumers (head caches, tracker, observers, features), the forwards under
    way, ...), open intervene/sentences blocks,
    forward hooks and replaced `forward` methods other than those attnkit keeps on every instrumented model (marked
    `_attnkit_hook`: the hooks that record a forward's inputs), and every change to the process attnkit still holds
    (`attnkit.process_changes()`: threads, environment variables, ...)."""
    rt = runtime_of(model)
    out: dict[str, object] = {}
    for f in dataclasses.fields(rt):
        if f.name in MODEL_FIELDS:
            continue
        rest = f.default_factory() if f.default is dataclasses.MISSING else f.default
        value = getattr(rt, f.name)
        if not _at_rest(value, rest):
            out[f"runtime.{f.name}"] = value
    if open_blocks(model):
        out["open blocks"] = open_blocks(model)
    for name, mod in model.named_modules():
        hooks = [h for d in (mod._forward_hooks, mod._forward_pre_hooks, mod._backward_hooks)
                 for h in d.values() if not getattr(h, "_attnkit_hook", False)]
        if hooks:
            out[f"hooks on {name or 'the model'}"] = hooks
        if "forward" in vars(mod) and not getattr(vars(mod)["forward"], "_attnkit_hook", False):
            out[f"forward of {name or 'the model'} replaced"] = vars(mod)["forward"]
    if attnkit.process_changes():
        out["process changes"] = attnkit.process_changes()
    return out


@contextlib.contextmanager
def ctrl_c(layer: torch.nn.Module, n: int):
    """KeyboardInterrupt from a forward hook on `layer` at its `n`-th call; the block expects it."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt

    handle = layer.register_forward_hook(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        handle.remove()
    assert len(calls) == n


def same(a, b) -> None:
    """Exactly equal numbers, through dicts, lists, tuples, HeadFeatures, DataFrames, arrays and tensors."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif hasattr(a, "to_numpy"):  # a DataFrame
        assert a.columns.tolist() == b.columns.tolist()
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())
    elif hasattr(a, "mean") and hasattr(a, "std") and not isinstance(a, np.ndarray):  # HeadFeatures
        np.testing.assert_array_equal(a.mean, b.mean)
        np.testing.assert_array_equal(a.std, b.std)
    elif isinstance(a, (np.ndarray, float, int, np.floating)):
        np.testing.assert_array_equal(a, b)


# --- the cases ------------------------------------------------------------------------------------------------
# Each: (which model, the call, the layer whose n-th forward raises, n). A call takes (model, tokenizer) and
# returns its numbers.

def _extract(model, tok):
    return attnkit.extract(SENTENCES, (model, tok), batch_size=2, max_length=32)


def _head_means(model, tok):
    return attnkit.head_means(SENTENCES, (model, tok), batch_size=2, max_length=32).mean


def _detect(model, tok):
    return attnkit.detect_heads((model, tok), length=6, n_sequences=4, seed=1)


def _ablate(model, tok, path):
    from attnkit.ablation import TaskEvaluator, get_task

    evaluate = TaskEvaluator(get_task("stsb", path), model, tok, limit=6, batch_size=4)
    ivs = [Intervention.from_heads(model, "L2H3", mode="zero"), Intervention.from_layers(model, 4, mode="uniform")]
    return [metrics for metrics, _ in evaluate.evaluate_many(ivs)]


def _enc(tok, pair=False):
    texts = SENTENCES[:3]
    args = (texts, SENTENCES[2:5]) if pair else (texts,)
    return tok(*args, return_tensors="pt", padding=True)


def _track(model, tok):
    enc = _enc(tok)
    with attnkit.track(model, features=("entropy", "max_logit")) as tracker, torch.no_grad():
        model(**enc)
        model(**enc)
        return tracker.read()


def _intervene(model, tok):
    enc = _enc(tok, pair=True)
    ids = (enc["token_type_ids"] + (enc["input_ids"] == tok.sep_token_id).cumsum(-1)).int()
    iv = Intervention.from_heads(model, "L1H2,L4", mode="uniform").set(3, 0, region="no_inter")
    with attnkit.intervene(model, iv, sentences=ids), torch.no_grad():
        model(**enc)
        return model(**enc).last_hidden_state


def _cache_heads(model, tok):
    enc = _enc(tok)
    with attnkit.cache_heads(model, layers=[1, 4]) as cache, torch.no_grad():
        model(**enc)
        model(**enc)
    return dict(cache.items())


def _generate(model, tok):
    enc = tok(DECODER_TEXTS, return_tensors="pt", padding=True, padding_side="left")
    with attnkit.intervene(model, Intervention.from_heads(model, "L1H2", mode="zero")):
        return model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _train(model, tok, path):
    from transformers import Trainer, TrainingArguments

    from attnkit.training import AttnkitCallback

    enc = tok(["the cat sat on", "the dog slept and", "rivers bend lakes form"], return_tensors="pt")
    data = [{"input_ids": i, "attention_mask": m, "labels": i} for i, m in zip(enc["input_ids"],
                                                                               enc["attention_mask"])]
    cb = AttnkitCallback(features=("entropy",), every=1)
    args = TrainingArguments(output_dir=str(path / "out"), per_device_train_batch_size=3, max_steps=1,
                             learning_rate=0.0, report_to=[], use_cpu=True, logging_strategy="no",
                             save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    ALIVE.append(trainer)  # as a notebook keeps its trainer after Ctrl-C (cleanup must not wait for the collector)
    try:
        trainer.train()
    finally:
        model.eval()  # Trainer leaves its model training, which is Trainer's state, not attnkit's
    return [stats for _, stats in cb.history]


ALIVE: list = []  # objects a case keeps until its test ends

ENCODER_CASES = {"extract": (_extract, 2), "head means": (_head_means, 2), "ablate": (_ablate, 3),
                 "track": (_track, 2), "intervene": (_intervene, 2), "cache_heads": (_cache_heads, 2)}
DECODER_CASES = {"detect-heads": (_detect, 1), "generate": (_generate, 3), "Trainer": (_train, 1)}


@pytest.fixture(scope="module")
def stsb_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("stsb") / "dev.tsv"
    rows = ["index\tgenre\tsentence1\tsentence2\tscore"]
    rows += [f"{i}\tx\t{SENTENCES[i % 5]}\t{SENTENCES[(i * 2 + 1) % 5]}\t{i % 5}.0" for i in range(8)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def encoder(minilm):
    model, tok = minilm
    return copy.deepcopy(model), tok  # not the session's MiniLM: a failing case must not leave its state there


@pytest.fixture(scope="module")
def decoder(decoder_tokenizer):
    tok = copy.deepcopy(decoder_tokenizer)
    tok.pad_token = tok.eos_token
    return attnkit.instrument(tiny_decoder("llama", vocab=len(tok), n_layers=2)), tok


def _plain_forward(model, tok):
    enc = _enc(tok) if getattr(model.config, "type_vocab_size", 0) else tok(DECODER_TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("case", [*ENCODER_CASES, *DECODER_CASES])
def test_ctrl_c_leaves_nothing_of_attnkit_on_the_model(case, encoder, decoder, stsb_path, tmp_path):
    call, n = {**ENCODER_CASES, **DECODER_CASES}[case]
    base, tok = encoder if case in ENCODER_CASES else decoder
    if call in (_ablate, _train):
        call = (lambda c, p: lambda model, tok: c(model, tok, p))(call, stsb_path if call is _ablate else tmp_path)
    model = copy.deepcopy(base)
    fresh = copy.deepcopy(model)
    assert held(model) == {}
    try:
        with ctrl_c(encoder_layers(model)[1], n):
            call(model, tok)
        assert held(model) == {}
        same(call(model, tok), call(fresh, tok))
        assert held(model) == {}
        same(_plain_forward(model, tok), _plain_forward(fresh, tok))
    finally:
        ALIVE.clear()


def test_held_sees_what_attnkit_holds(encoder):
    """The helper above finds each thing a block or a forward leaves, so that an empty `held` means something."""
    model, tok = copy.deepcopy(encoder[0]), encoder[1]
    assert held(model) == {}
    with attnkit.intervene(model, Intervention.for_model(model)):
        assert set(held(model)) == {"runtime.given", "open blocks"}
    for block in (attnkit.cache_heads(model), attnkit.track(model)):
        with block:
            assert len(held(model)) == 1  # the runtime's field that holds the cache, the tracker
    seen = []

    def inside(module, args, output):
        seen.append(held(model))

    handle = encoder_layers(model)[0].register_forward_hook(inside)
    with torch.no_grad():
        model(**_enc(tok))
    handle.remove()
    assert "runtime.forwards" in seen[0] and "hooks on encoder.layer.0" in seen[0]
    assert held(model) == {}
