"""Shared fixtures: the embedded MiniLM (loaded once), tiny tokenizers built in code, a full disk, another process
holding a run directory's lock. (Synthetic features and a tiny BERT: tests/synthetic.py.)"""
import contextlib
import multiprocessing
import os

import pytest

# How torch's OpenMP threads wait between parallel regions: the one rule of attnkit/engine/openmp.py, as every
# command applies it, decided before anything imports torch (libgomp reads the variables when torch loads). The
# tests run thousands of tiny inputs, each many short parallel regions: on a machine whose other work keeps the
# cores busy, libgomp's spinning waits made tiny models 10-30x slower (a 40-step toy BERT: 0.4 s sleeping, 8.5 s
# spinning, at load 3.5 on 2 cores). The regime changes no number; a value in the environment wins.
from attnkit.engine.openmp import configure  # noqa: E402  (imports no torch)

configure(os.environ)  # for the whole session and its subprocesses (the suite asks for it)

# The Triton kernel's real code runs on the CPU under Triton's interpreter (tests/test_triton_attention.py). Triton
# decides at definition which of its own @triton.jit functions (tl.zeros, ...) are interpreted, so the variable must be
# set before anything of the session imports triton (torch and transformers may); on a GPU machine
# (ATTNKIT_TRITON_DEVICE=cuda, tools/gpu_check.sh) the compiled kernel runs instead.
if os.environ.get("ATTNKIT_TRITON_DEVICE") != "cuda":
    os.environ["TRITON_INTERPRET"] = "1"

from .synthetic import layered_truth, make_features  # noqa: E402

# `-n auto` (README's test command): one worker per core this process may use (the container's CPU quota and
# affinity, as attnkit's own thread regime reads them), at most 4: each worker holds torch, transformers and the
# models its tests load, and the tests that measure threads or run Ray start processes of their own.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    from attnkit.engine.openmp import available_cores

    return max(1, min(MAX_WORKERS, available_cores()))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCES = [
    "The cat sat on the mat, and the dog slept.",
    "Rivers bend. Lakes form where the bend is cut!",
    "Short one.",
    "A bridge is a promise made in steel, stone and patience. Nobody thinks about it?",
    "Bread needs time, water, salt, flour and yeast.",
]


@pytest.fixture(scope="session")
def minilm():
    import attnkit

    return attnkit.load_model(device="cpu")


@pytest.fixture(scope="session")
def minilm_eager():
    """The embedded MiniLM with transformers' eager attention, the reference the attnkit model is compared with
    (loaded once per test session; tests only run it)."""
    from transformers import AutoModel

    from attnkit.models import default_model_path

    return AutoModel.from_pretrained(default_model_path(), attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """ATTNKIT_CACHE for the whole session, holding ONE converted SmolLM2 copy (the conversion takes about a minute)
    that every test needing the embedded decoder shares: the environment's ATTNKIT_CACHE where it is set (a copy
    kept across sessions), else a folder under pytest's base temporary directory (its parent under pytest-xdist,
    shared by the workers). Skips without the extra attnkit[decoders]."""
    from attnkit.embedded import INSTALL_DECODERS, embedded_path, missing_packages

    if missing_packages():
        pytest.skip(f"the embedded decoder needs {', '.join(missing_packages())}: {INSTALL_DECODERS}")

    # under pytest-xdist each worker has its own base directory, under one parent: the workers share the parent's
    # copy (attnkit converts under a file lock, so one worker converts while the others wait for it)
    base = tmp_path_factory.getbasetemp()
    base = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = os.environ.get("ATTNKIT_CACHE") or str(base / "attnkit-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("ATTNKIT_CACHE", cache)
    try:
        embedded_path("smollm2")
        yield cache
    finally:
        patch.undo()


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    """The embedded decoder, base model (no LM head), loaded once."""
    import attnkit

    return attnkit.load_model("smollm2", device="cpu")


@pytest.fixture(scope="session")
def decoder_tokenizer():
    """A word-level fast tokenizer of a decoder built in code: BOS <s> (added in front), EOS </s>, no cls, sep or
    padding token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", ",", ".", "!", "?"] + sorted({w.strip(",.!?").lower() for s in SENTENCES
                                                                  for w in s.split()} - {""})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def roberta_tokenizer():
    """A byte-level BPE tokenizer with RoBERTa's special tokens and pair template, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 3 + [", . ! ?"], trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def write_clusters_json(run, type_grid):
    """A clusters.json in the format `attnkit cluster` writes (docs/files.md, "clusters.json"), for the
    given layers × heads grid of type names."""
    import json
    from pathlib import Path

    run = Path(run)
    run.mkdir(parents=True, exist_ok=True)
    names = sorted({t for row in type_grid for t in row})
    heads = [{"layer": l, "head": h, "label": names.index(t), "type": t}
             for l, row in enumerate(type_grid) for h, t in enumerate(row)]
    data = {"version": 1, "settings": {"k": len(names)},
            "run": {"n_layers": len(type_grid), "n_heads": len(type_grid[0])}, "heads": heads,
            "clusters": [{"label": i, "type": t} for i, t in enumerate(names)], "stability": {}}
    (run / "clusters.json").write_text(json.dumps(data))
    return run


@pytest.fixture(scope="module")
def feats(request):
    """Synthetic features of a small run (tests/synthetic.py): 3 layers × 4 heads, or the layers, heads and seed
    that the test module sets in FEATS (a dict of layered_truth's arguments)."""
    return make_features(layered_truth(**getattr(request.module, "FEATS", {"L": 3, "H": 4, "seed": 1})))


@pytest.fixture
def run(tmp_path, feats):
    """A run directory holding `feats`."""
    feats.save(tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def full_disk(monkeypatch):
    """Writing any temporary file (attnkit writes through `.tmp` files) fails with ENOSPC."""
    import builtins
    import errno

    real_open = builtins.open

    def full_open(path, mode="r", *a, **k):
        if "w" in mode and str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", full_open)


def _hold_lock(directory, command, ready):
    from attnkit.run.locking import run_lock

    with run_lock(directory, command):
        ready.set()
        multiprocessing.Event().wait(120)


@contextlib.contextmanager
def _lock_held(directory, command="attnkit extract"):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(directory), command, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(30), "the lock holder did not start"
        yield proc.pid
    finally:
        proc.kill()
        proc.join()


@pytest.fixture
def lock_held():
    """`with lock_held(directory, command) as pid`: a forked process (started in milliseconds: fork inherits the
    loaded modules) holds `directory`'s lock (attnkit.run.locking.run_lock) as `command` until the block ends."""
    return _lock_held


@pytest.fixture
def paused_extract():
    """`start(args)`: `attnkit <args>` in a subprocess standing still after its first checkpoint
    (tests/paused_extract.py). Whatever the test's end, a run it left standing is killed."""
    from .paused_extract import start_paused

    started = []

    def start(args):
        started.append(start_paused(args))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

