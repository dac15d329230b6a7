"""Shared fixtures: the embedded MiniLM (loaded once) and tiny tokenizers built in code."""
import os

import pytest

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
    """A clusters.json in the format `attnkit cluster` writes (attnkit/analysis/results.py), for the
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
