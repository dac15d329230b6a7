"""The embedded decoder (attnkit/embedded, docs/decoders.md): the cached copy's checks (made once under a lock,
a damaged copy rebuilt, the cache folder from the environment), the refusal without the extra, a decoder
tokenizer's token classes, whole files as segments, and SmolLM2 itself (one converted copy for the session:
conftest.smollm2_cache) against eager attention."""
from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pytest
import torch

import attnkit
from attnkit.embedded import cache_dir, copy_problem, embedded_path, ensure_copy
from attnkit.errors import AttnkitError
from attnkit.features import CLS, OTHER, SEP
from attnkit.tokens import Encoder

from .synthetic import features_from_maps


def fake_convert(calls):
    def convert(out):
        calls.append(out)
        (out / "config.json").write_text('{"a": 1}')
        (out / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    return convert


def test_the_copy_is_made_once_and_rebuilt_when_damaged(tmp_path):
    calls = []
    where = tmp_path / "cache" / "m"
    assert ensure_copy(where, fake_convert(calls), "src") == where
    assert len(calls) == 1 and copy_problem(where) is None
    assert json.loads((where / "manifest.json").read_text())["files"]["config.json"]["size"] == 8
    ensure_copy(where, fake_convert(calls))
    assert len(calls) == 1  # intact: read, not converted
    data = bytearray((where / "model.safetensors").read_bytes())
    data[100] ^= 1  # one flipped bit, same size
    (where / "model.safetensors").write_bytes(bytes(data))
    assert copy_problem(where) == "model.safetensors does not match its checksum in manifest.json"
    ensure_copy(where, fake_convert(calls))
    assert len(calls) == 2 and copy_problem(where) is None
    (where / "manifest.json").unlink()  # a conversion that died before its manifest
    assert copy_problem(where) == "it has no readable manifest.json"
    ensure_copy(where, fake_convert(calls))
    assert len(calls) == 3 and copy_problem(where) is None
    (where / "config.json").unlink()
    assert copy_problem(where) == "config.json is missing"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m", "m.lock"]  # no temporary left


def test_the_conversion_is_announced_once_in_one_line(tmp_path, capsys):
    calls = []
    where = tmp_path / "m"
    ensure_copy(where, fake_convert(calls), announce=lambda: "attnkit: converting m once (1 MB)")
    ensure_copy(where, fake_convert(calls), announce=lambda: "attnkit: converting m once (1 MB)")  # read, not said
    assert len(calls) == 1 and capsys.readouterr().err == "attnkit: converting m once (1 MB)\n"


def test_the_first_use_of_smollm2_says_it_converts_once_and_how_big(tmp_path, monkeypatch):
    from attnkit import embedded

    if embedded.missing_packages():
        pytest.skip("the embedded decoder's packages are not installed")
    said = []
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "ensure_copy", lambda d, convert, source="", announce=None: said.append(announce()))
    embedded_path("smollm2")
    [line] = said
    assert line.startswith(f"attnkit: converting the embedded SmolLM2 once into {tmp_path}/smollm2-")
    mb = float(line.split(" (")[1].split(" MB")[0].replace(",", ""))
    assert 500 < mb < 560  # 135 M float32 weights (538 MB written)


def test_two_loaders_at_once_convert_once(tmp_path):
    calls, errors = [], []
    where = tmp_path / "m"

    def load():
        try:
            ensure_copy(where, fake_convert(calls))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1 and copy_problem(where) is None


def test_cache_folder_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"
    monkeypatch.delenv("ATTNKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "attnkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "attnkit"


def test_without_the_extra_the_name_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(AttnkitError, match=r"the embedded decoder smollm2 needs gguf: pip install "
                                           r"'attnkit\[decoders\]'"):
        attnkit.load_model("smollm2")
    with pytest.raises(AttnkitError, match="unknown embedded model 'gpt5'"):
        embedded_path("gpt5")


def test_the_embedded_name_passes_every_command_s_model_check(tmp_path, monkeypatch):
    # `attnkit ablate smollm2 ...` was refused as "a Hugging Face Hub id" by its check before the model loads, while
    # extract and detect-heads took the name: the name is now known where model directories are checked
    from attnkit.ablation.options import AblateOptions, preflight_ablate
    from attnkit.run.model_dir import check_model_dir

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "d.txt"
    data.write_text("one line of text\n")
    check_model_dir("smollm2")
    preflight_ablate(AblateOptions(model="smollm2", task_name="lm", data=str(data), experiment="layers",
                                   out=str(tmp_path / "out")))
    with pytest.raises(AttnkitError, match="looks like a Hugging Face Hub id"):
        check_model_dir("smollm3")
    (tmp_path / "smollm2").mkdir()  # a directory of that name here is what the name means
    with pytest.raises(AttnkitError, match="directory is incomplete"):
        check_model_dir("smollm2")


def test_decoder_token_classes_and_pairs(decoder_tokenizer):
    enc = Encoder(decoder_tokenizer, max_length=16)
    assert enc.causal and decoder_tokenizer.pad_token == "</s>"  # pads with EOS: the mask marks padding
    ids = decoder_tokenizer.convert_tokens_to_ids
    batch = enc(["the cat sat , </s> short one .", "<s> bread"])
    got = batch.token_class.numpy()
    assert batch.inputs["input_ids"][0, :2].tolist() == [ids("<s>"), ids("the")]
    assert got[0, 0] == CLS and got[0, 4] != SEP and got[0, 5] == SEP  # </s> at position 5 (after <s>)
    assert got[1].tolist()[:3] == [CLS, OTHER, OTHER]  # a BOS past the first position is OTHER
    with pytest.raises(AttnkitError, match=r"text pairs need a model with a pair format \(\[CLS\] A \[SEP\] B "
                                           r"\[SEP\]\); this is a decoder's tokenizer"):
        enc([("the cat", "sat")])
    assert not Encoder(decoder_tokenizer, causal=False).causal


def test_whole_files_are_one_segment(tmp_path):
    from attnkit.corpus import open_corpus

    doc = tmp_path / "doc.txt"
    doc.write_text("First line.\nSecond line.\n\nA new paragraph.\n")
    assert list(open_corpus([str(doc)], text_unit="file")) == ["First line.\nSecond line.\n\nA new paragraph."]
    assert list(open_corpus([str(doc)], text_unit="paragraph")) == ["First line. Second line.", "A new paragraph."]


@pytest.mark.slow
def test_smollm2_predicts_and_its_features_equal_eager_maps(smollm2, smollm2_cache):
    from transformers import AutoModel

    model, tok = smollm2
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == ("llama", 30, 9, 3, 64)
    lm, _ = attnkit.load_model("smollm2", task="causal-lm", device="cpu")
    enc = tok("The capital of France is Paris. The capital of Germany is", return_tensors="pt")
    with torch.no_grad():
        assert tok.decode(lm(**enc).logits[0, -1].argmax()) == " Berlin"
    del lm
    texts = ["The cat sat on the mat, and the dog slept.", "Short one."]
    nw = 8
    feats = attnkit.extract(texts, (model, tok), num_windows=nw, max_length=32)
    batch = Encoder(tok, max_length=32)(texts)
    eager = AutoModel.from_pretrained(str(embedded_path("smollm2")), attn_implementation="eager").eval()
    with torch.no_grad():
        maps = [a.numpy() for a in eager(**batch.inputs, output_attentions=True).attentions]
    per = features_from_maps(maps, batch.lengths.tolist(), batch.token_class.numpy(), batch.sentence_id.numpy(), nw)
    np.testing.assert_allclose(feats.mean, per.mean(0), atol=2e-5)
    assert feats.mean[20:, :, 0].mean() > 0.5  # the sink: the first position takes most of late layers' mass


@pytest.mark.slow
def test_extract_a_whole_file_with_model_smollm2(smollm2_cache, tmp_path):
    from click.testing import CliRunner

    from attnkit.cli.main import main
    from attnkit.run import HeadFeatures

    doc = tmp_path / "doc.txt"
    doc.write_text("The first paragraph talks about rivers.\n\nThe second one, shorter, about lakes.\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["extract", str(doc), "--model", "smollm2", "--text-unit", "file",
                                       "--max-length", "64", "-o", str(out), "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    feats = HeadFeatures.load(out)
    assert feats.n_samples == 1 and feats.mean.shape == (30, 9, len(attnkit.feature_names()))
    assert json.loads((out / "meta.json").read_text())["settings"]["model"] == "smollm2"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_every_file_of_the_copy_gets_the_mode_of_the_umask(tmp_path, umask, mode):
    """Issue 46 item 2: safetensors writes model.safetensors 0600 (through a temporary file) where the copy's other
    files are 0644: the copy gets the umask's mode throughout. A conversion that writes as safetensors does."""
    import os
    import stat

    def convert(out):
        (out / "config.json").write_text('{"a": 1}')
        fd = os.open(out / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"weights")
        os.close(fd)

    old = os.umask(umask)
    try:
        where = ensure_copy(tmp_path / "m", convert)
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in where.iterdir()} == {
        "config.json": mode, "model.safetensors": mode, "manifest.json": mode}
