"""The Ray engine (attnkit.engine.ray) against the in-process loop, on one local cluster for the module.

Every run here measures the same few hundred real English segments with the embedded MiniLM on CPU; the Ray
numbers must equal `run_extraction`'s (and the in-process distance collector's) to 1e-12 relative, also after
a resume from shard files and after a model actor was killed in the middle of a run (the std to 1e-12 of the
terms it is computed from: see `_assert_same_features`).
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attnkit.corpus import default_corpus_path
from attnkit.engine import ExtractSettings
from attnkit.engine.ray import PID_DIR_ENV, run_ray_distances, run_ray_extraction, shard_dir
from attnkit.errors import AttnkitError

try:
    import ray
    import ray.data  # noqa: F401
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason="Ray Data is not installed: pip install 'attnkit[distributed]'")

ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 40
BATCH = 8
WINDOW = 32
SETTINGS = {"corpus": "default_corpus sentences, pairs, paragraphs", "max_length": MAX_LENGTH}
SETTINGS_OF_PLAN = ExtractSettings(max_length=MAX_LENGTH, batch_size=BATCH, window=WINDOW)


def _corpus():
    """Sentences of the built-in corpus, pairs of neighbouring sentences and whole paragraphs (some longer than
    MAX_LENGTH tokens, so truncation is counted): a few hundred segments of real English, lengths mixed."""
    text = default_corpus_path().read_text(encoding="utf-8")
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    sentences = [s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if s]
    pairs = [(a, b) for a, b in zip(sentences, sentences[1:])]
    out = []
    for i in range(max(len(sentences), len(pairs), len(paragraphs))):  # interleaved: every window is mixed
        for part in (sentences, pairs, paragraphs):
            if i < len(part):
                out.append(part[i])
    return out


@pytest.fixture(scope="module")
def cluster():
    if ray is None:
        pytest.skip("Ray Data is not installed: pip install 'attnkit[distributed]'")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus():
    segs = _corpus()
    assert 200 <= len(segs) <= 400
    return segs


@contextlib.contextmanager
def one_thread():
    """The in-process loop with the thread count of a CPU model actor (1): on CPU the per-sample numbers of
    thin batches depend on how many threads BLAS splits a matmul over (see attnkit.engine.ray)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def in_process(minilm, corpus):
    from attnkit.engine import run_extraction

    model, tokenizer = minilm
    with one_thread():
        state = run_extraction(model, tokenizer, corpus, SETTINGS_OF_PLAN)
    return state.accumulator, state.n_truncated


def _run(corpus, run_dir, batch_size=BATCH, **kw):
    kw = {"model_path": None, "run_dir": run_dir, "run_settings": SETTINGS, "progress": False, **kw}
    settings = ExtractSettings(max_length=MAX_LENGTH, batch_size=batch_size, window=WINDOW)
    return run_ray_extraction(corpus, settings, **kw)


def _assert_same_features(acc, ref):
    assert (acc.n_samples, acc.n_tokens) == (ref.n_samples, ref.n_tokens)
    np.testing.assert_allclose(acc.sum, ref.sum, rtol=1e-12, atol=0)
    np.testing.assert_allclose(acc.m2, ref.m2, rtol=1e-12, atol=1e-300)
    a, b = acc.result(), ref.result()
    np.testing.assert_allclose(a.mean, b.mean, rtol=1e-12, atol=0)
    np.testing.assert_allclose(a.std, b.std, rtol=1e-12, atol=0)


@needs_ray
@pytest.mark.slow
def test_ray_features_equal_in_process_and_resume_skips_finished_shards(cluster, corpus, in_process, tmp_path):
    ref, ref_truncated = in_process
    acc, n_truncated, info = _run(corpus, tmp_path)
    n_shards = -(-len(corpus) // WINDOW)
    assert info["engine"] == "ray" and info["shards"] == n_shards and info["shards_skipped"] == 0
    assert info["actors"] == 1  # 2 CPUs: one model actor, one CPU left for tokenisation
    assert n_truncated == ref_truncated > 0
    _assert_same_features(acc, ref)
    files = sorted(shard_dir(tmp_path).glob("shard-*.npz"))
    assert [f.name for f in files] == [f"shard-{k:06d}.npz" for k in range(n_shards)]

    # an interrupted run: two shards never finished; the rerun measures only those (one Ray Data execution per
    # shard here, finished shards merged between them) and ends the same
    files[1].unlink()
    files[-1].unlink()
    acc2, n_truncated2, info2 = _run(corpus, tmp_path, shards_per_group=1)
    assert info2["shards_skipped"] == n_shards - 2
    assert len(list(shard_dir(tmp_path).glob("shard-*.npz"))) == n_shards
    assert n_truncated2 == ref_truncated
    _assert_same_features(acc2, ref)

    # nothing left to do: everything comes from the shard files
    acc3, _, info3 = _run(corpus, tmp_path)
    assert info3["shards_skipped"] == n_shards
    _assert_same_features(acc3, ref)

    # shards measured under other settings are refused, with one line naming what differs
    with pytest.raises(AttnkitError, match=r"shard-000000\.npz was written under other settings "
                                           r"\(settings\.max_length: 40 then, 41 now\)") as e:
        _run(corpus, tmp_path, run_settings={**SETTINGS, "max_length": 41})
    assert "\n" not in str(e.value)
    with pytest.raises(AttnkitError, match=r"engine\.batch_size: 8 then, 4 now"):
        _run(corpus, tmp_path, batch_size=4)


def test_importing_attnkit_does_not_import_ray():
    code = "import sys, attnkit, attnkit.engine.ray; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_without_ray_the_engine_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(AttnkitError, match=r"^the ray engine needs Ray Data, which is not installed: "
                                           r"pip install 'attnkit\[distributed\]'$"):
        run_ray_extraction(["A text."], model_path=None, run_dir=tmp_path, run_settings={}, progress=False)


@needs_ray
@pytest.mark.slow
def test_killing_a_model_actor_mid_run_changes_nothing(cluster, corpus, in_process, tmp_path, monkeypatch):
    """The one model actor stands still before its last batch (HOLD_FILE), so it is killed mid-run whatever the
    machine's pace: then at least one shard is written and one is not."""
    from attnkit.engine.plan import plan_batches
    from attnkit.engine.ray.workers import HOLD_FILE

    ref, ref_truncated = in_process
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setenv(PID_DIR_ENV, str(pid_dir))
    run_dir = tmp_path / "run"
    shards = shard_dir(run_dir)
    n_shards = -(-len(corpus) // WINDOW)
    n_batches = sum(1 for _ in plan_batches(corpus, BATCH, WINDOW, grouped=True))  # planned units, as Ray runs them
    (pid_dir / HOLD_FILE).write_text(str(n_batches - 1))
    out: dict = {}

    def target():
        try:  # one actor and one group of shards: the actor's count of batches is the run's
            out["result"] = _run(corpus, run_dir, num_actors=1, shards_per_group=n_shards)
        except BaseException as exc:  # reported by the assertion below
            out["error"] = exc

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    killed = done_at_kill = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and runner.is_alive():  # waits for a state the run must reach; no race
        held = sorted(pid_dir.glob("*.held"))
        done = len(list(shards.glob("shard-*.npz"))) if shards.is_dir() else 0
        if held and done >= 1:  # the actor stands still, and the driver has written a shard
            killed, done_at_kill = int(held[0].stem), done
            os.kill(killed, signal.SIGKILL)
            (pid_dir / HOLD_FILE).unlink()  # its successor measures the last batch
            break
        time.sleep(0.05)
    runner.join(timeout=240)
    assert not runner.is_alive(), "the run did not finish after its actor was killed"
    assert killed is not None, f"the actor never stood still before its last batch: {out.get('error')}"
    assert 1 <= done_at_kill < n_shards
    assert "error" not in out, out.get("error")
    acc, n_truncated, info = out["result"]
    restarted = {int(p.stem) for p in pid_dir.glob("*.pid")} - {killed}
    assert restarted, "no model actor started after the kill"
    assert info["shards"] == n_shards and info["shards_skipped"] == 0
    assert n_truncated == ref_truncated
    _assert_same_features(acc, ref)


@needs_ray
@pytest.mark.slow
def test_ray_distances_equal_the_in_process_collector(cluster, corpus, minilm, tmp_path):
    from attnkit.engine import DistanceCollector, run_extraction
    from attnkit.models import attention_modules

    model, tokenizer = minilm
    segs = corpus[:120]
    collector = DistanceCollector(len(attention_modules(model)))
    with one_thread():
        run_extraction(model, tokenizer, segs, SETTINGS_OF_PLAN, observers=[collector])
    ref = collector.result()
    dist, info = run_ray_distances(segs, SETTINGS_OF_PLAN, model_path=None, run_dir=tmp_path, run_settings=SETTINGS,
                                   progress=False)
    assert (dist.n_layers, dist.n_heads, dist.n_rows) == (ref.n_layers, ref.n_heads, ref.n_rows)
    assert info["shards"] == -(-len(segs) // WINDOW)
    assert np.all(ref.total[~np.eye(len(ref.total), dtype=bool)] > 0)
    np.testing.assert_allclose(dist.total, ref.total, rtol=1e-12, atol=0)
    assert sorted(p.name for p in shard_dir(tmp_path, "distances").glob("*.npz"))[0] == "shard-000000.npz"
    assert not shard_dir(tmp_path).exists()  # feature shards live elsewhere: a run dir can hold both


def test_an_address_where_nothing_listens_is_refused_at_once():
    """Ray retries an address where nothing listens for minutes; attnkit asks it once, with a time limit."""
    import socket

    from attnkit.engine.ray import check_ray_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound but not listening: connections are refused
        port = s.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            with pytest.raises(AttnkitError, match=rf"^could not reach the Ray cluster at '{address}' \(Connection "
                                                   r"refused\): is its head node running \(ray start --head\), and "
                                                   r"is ray_address right\?$"):
                check_ray_address("ray", address)
    check_ray_address("ray", "auto")  # left to Ray


@needs_ray
@pytest.mark.slow
def test_ray_on_a_decoder_with_sinks_equals_in_process(cluster, tmp_path, decoder_tokenizer):
    """A tiny gpt-oss (causal, grouped-query, sliding windows, a sink per head) saved with a decoder tokenizer:
    the Ray engine's features equal the in-process loop's, the feature `sink` named last; and so do its
    Jensen-Shannon distances (`attnkit distances --engine ray` on a decoder run)."""
    from attnkit.engine import DistanceCollector, run_extraction
    from attnkit.features import feature_names
    from attnkit.models import attention_modules, load_model

    from .conftest import SENTENCES
    from .synthetic import tiny_decoder

    path = tmp_path / "tiny-gpt-oss"
    tiny_decoder("gpt_oss", vocab=len(decoder_tokenizer)).save_pretrained(path)
    decoder_tokenizer.save_pretrained(path)
    texts = [s.lower() for s in SENTENCES] * 8
    model, tokenizer = load_model(str(path), device="cpu")
    with one_thread():
        ref = run_extraction(model, tokenizer, texts, SETTINGS_OF_PLAN).accumulator
    acc, _, info = _run(texts, tmp_path / "run", model_path=str(path))
    assert info["engine"] == "ray" and acc.names == ref.names == feature_names(16, sink=True)
    _assert_same_features(acc, ref)
    collector = DistanceCollector(len(attention_modules(model)))
    with one_thread():
        run_extraction(model, tokenizer, texts, SETTINGS_OF_PLAN, observers=[collector])
    want = collector.result()
    dist, _ = run_ray_distances(texts, SETTINGS_OF_PLAN, model_path=str(path), run_dir=tmp_path / "run",
                                run_settings=SETTINGS, progress=False)
    assert (dist.n_layers, dist.n_heads, dist.n_rows) == (want.n_layers, want.n_heads, want.n_rows)
    assert np.all(want.total[~np.eye(len(want.total), dtype=bool)] > 0)
    np.testing.assert_allclose(dist.total, want.total, rtol=1e-12, atol=0)


@needs_ray
@pytest.mark.slow
def test_ray_over_pairs_of_an_encoder_decoder_equals_in_process(cluster, tmp_path):
    """A tiny BART saved with a word-level tokenizer, over (source, target) pairs (docs/seq2seq.md §5): the Ray
    engine's features of every head of the three kinds equal the in-process loop's."""
    from attnkit.engine import run_extraction
    from attnkit.models import load_model

    from .synthetic import tiny_seq2seq
    from .test_seq2seq_extract import PAIRS, word_tokenizer

    tok, vocab = word_tokenizer("bart")
    path = tmp_path / "tiny-bart"
    tiny_seq2seq("bart", vocab=vocab).save_pretrained(path)
    tok.save_pretrained(path)
    pairs = PAIRS * 6
    model, tokenizer = load_model(str(path), device="cpu")
    settings = ExtractSettings(max_length=32, batch_size=4, window=WINDOW)
    with one_thread():
        ref = run_extraction(model, tokenizer, pairs, settings).accumulator
    acc, _, info = run_ray_extraction(pairs, settings, model_path=str(path), run_dir=tmp_path / "run",
                                      run_settings={"corpus": "PAIRS × 6", "max_length": 32}, progress=False)
    assert info["engine"] == "ray" and acc.sum.shape[:2] == (6, 4)  # 2 encoder, 2 decoder, 2 cross layers
    _assert_same_features(acc, ref)


@needs_ray
@pytest.mark.slow
def test_ray_over_images_equals_the_local_engine(cluster, tmp_path, monkeypatch):
    """A tiny ViT over a folder of image files named relative to the working directory (a Ray worker runs in
    another one): `attnkit extract --images DIR --engine ray` and `attnkit distances RUN --engine ray` give the
    local engine's numbers at the same thread count, with the image features named as the local run names them."""
    pytest.importorskip("PIL")
    from click.testing import CliRunner

    from attnkit.cli.main import main
    from attnkit.features import IMAGE_FEATURES
    from attnkit.run.distances import HeadDistances
    from attnkit.run.head_features import HeadFeatures

    from .test_images import save_model, write_images

    model = save_model(tmp_path / "vit", "vit")
    paths = write_images(tmp_path / "images")
    monkeypatch.chdir(tmp_path)
    common = ["--model", str(model), "--images", "images", "--batch-size", "2", "-q"]
    runs = {"local": ["--device", "cpu", "--threads", "1", "--workers", "0"], "ray": ["--engine", "ray"]}
    for name, more in runs.items():
        with one_thread():  # the local distances at a CPU actor's thread count
            res = CliRunner().invoke(main, ["extract", *common, "-o", name, *more])
            assert res.exit_code == 0, res.output
            res = CliRunner().invoke(main, ["distances", name, "-q", *more[:2]])
            assert res.exit_code == 0, res.output
    local, on_ray = HeadFeatures.load(tmp_path / "local"), HeadFeatures.load(tmp_path / "ray")
    assert on_ray.names == local.names and set(IMAGE_FEATURES) <= set(on_ray.names)
    assert on_ray.n_samples == local.n_samples == len(paths) and on_ray.meta["engine"] == "ray"
    np.testing.assert_allclose(on_ray.mean, local.mean, rtol=1e-12, atol=0)
    np.testing.assert_allclose(on_ray.std, local.std, rtol=1e-12, atol=1e-300)
    assert not shard_dir(tmp_path / "ray").exists()
    want, got = HeadDistances.load(tmp_path / "local"), HeadDistances.load(tmp_path / "ray")
    assert got.n_rows == want.n_rows == len(paths) * 17  # [CLS] and 16 patches per image
    assert np.all(want.total[~np.eye(len(want.total), dtype=bool)] > 0)
    np.testing.assert_allclose(got.total, want.total, rtol=1e-12, atol=0)
