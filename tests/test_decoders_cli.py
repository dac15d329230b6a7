"""`attnkit extract` on a decoder (docs/decoders.md): a tiny random Llama saved with a decoder tokenizer built in
code; tokenisation workers, --per-sample and an interrupted run resumed give the numbers of the in-process
extraction."""
from __future__ import annotations

import signal

import numpy as np
import pytest
from click.testing import CliRunner

import attnkit
from attnkit.cli.main import main
from attnkit.run import HeadFeatures

from .conftest import SENTENCES
from .synthetic import tiny_decoder


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory, decoder_tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_decoder("llama", vocab=len(decoder_tokenizer)).save_pretrained(path)
    decoder_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(s.lower() for s in SENTENCES * 4) + "\n")
    return path


def test_workers_and_per_sample_give_the_in_process_numbers(decoder_dir, corpus, tmp_path):
    texts = corpus.read_text().splitlines()
    want = attnkit.extract(texts, str(decoder_dir), max_length=24, batch_size=4, num_windows=8)
    out = tmp_path / "run"
    code, text = run("extract", corpus, "--model", decoder_dir, "-o", out, "--workers", 2, "--per-sample",
                     "--max-length", 24, "--batch-size", 4, "--num-windows", 8, "-q")
    assert code == 0, text
    got = HeadFeatures.load(out)
    assert got.n_samples == len(texts) and got.names == attnkit.feature_names(8)
    np.testing.assert_allclose(got.mean, want.mean, atol=1e-6)
    per = np.load(out / "per_sample.npy")
    assert per.shape == (len(texts), 2, 4, len(got.names))
    np.testing.assert_allclose(per.mean(0), got.mean, atol=1e-5)


def test_interrupted_run_resumes_to_identical_numbers(decoder_dir, corpus, tmp_path, paused_extract):
    args = ["--model", decoder_dir, "--batch-size", 1, "-q", "--max-length", 24, "--threads", 1]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run("extract", corpus, "-o", full, *args)[0] == 0
    proc = paused_extract(["extract", corpus, "-o", part, "--checkpoint-every", 1, *args])
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    code, text = run("extract", corpus, "-o", part, "--resume", *args)
    assert code == 0, text
    a, b = HeadFeatures.load(full), HeadFeatures.load(part)
    np.testing.assert_array_equal(a.mean, b.mean)
    np.testing.assert_array_equal(a.std, b.std)
