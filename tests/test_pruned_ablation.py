"""ablate on a pruned model (issue 25, §5): the heads it lost are not settings of any experiment, in every mode
(mean included) and for patching; --mean-corpus takes '-' as extract's inputs do."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.cli.main import main

from .synthetic import WORDS, tiny_bert


def run(*args, input=None):
    res = CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A tiny BERT (3 layers × 4 heads) without L0H0, L0H1 and all of layer 1, and an STS-B file for it."""
    import torch
    from transformers import BertConfig, BertModel

    d = tmp_path_factory.mktemp("pruned")
    _, tok = tiny_bert(3, 4)
    torch.manual_seed(0)  # room for the tasks' 128 tokens, which head means are measured with
    model = BertModel(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
                                 intermediate_size=32, max_position_embeddings=160)).eval()
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    code, text = run("prune", d / "model", "--heads", "L0H0,L0H1,L1", "-o", d / "p", "-q")
    assert code == 0, text
    rng = np.random.default_rng(0)
    (d / "dev.tsv").write_text("index\tgenre\tsentence1\tsentence2\tscore\n" + "".join(
        f"{i}\tx\t{' '.join(rng.choice(WORDS, 5))}\t{' '.join(rng.choice(WORDS, 4))}\t{i % 5}.0\n" for i in range(8)))
    (d / "patch.tsv").write_text("clean\tcorrupted\treference\n" + "".join(
        f"{' '.join(rng.choice(WORDS, 5))}\t{' '.join(rng.choice(WORDS, 5))}\t{' '.join(rng.choice(WORDS, 4))}\n"
        for _ in range(6)))
    return d


KEPT = {(0, 2), (0, 3), (2, 0), (2, 1), (2, 2), (2, 3)}


@pytest.mark.parametrize("experiment", ["heads", "layers"])
def test_mean_ablation_of_a_pruned_model_leaves_the_removed_heads_out(pruned, tmp_path, experiment):
    out = tmp_path / "ab"
    code, text = run("ablate", pruned / "p", "--task", "stsb", "--data", pruned / "dev.tsv", "--experiment",
                     experiment, "--mode", "mean", "--resamples", 0, "-o", out, "-q")
    assert code == 0, text
    rows = json.loads((out / f"{experiment}.json").read_text())["rows"]
    if experiment == "heads":
        assert {(r["layer"], r["head"]) for r in rows[1:]} == KEPT
    else:  # layer 1 has no head left: no setting
        assert [r["layer"] for r in rows[1:]] == [0, 2]


def test_patching_a_pruned_model_patches_the_heads_it_has(pruned, tmp_path):
    out = tmp_path / "patch"
    code, text = run("ablate", pruned / "p", "--task", "stsb", "--data", pruned / "patch.tsv", "--experiment",
                     "patching", "--resamples", 0, "-o", out, "-q")
    assert code == 0, text
    rows = json.loads((out / "patching.json").read_text())["rows"]
    assert {(r["layer"], r["head"]) for r in rows[1:]} == KEPT


def test_the_mean_corpus_may_be_standard_input(pruned, tmp_path):
    out = tmp_path / "stdin"
    code, text = run("ablate", pruned / "p", "--task", "stsb", "--data", pruned / "dev.tsv", "--experiment", "heads",
                     "--mode", "mean", "--mean-corpus", "-", "--resamples", 0, "-o", out, "-q",
                     input="the cat sat on the mat\na dog ran far\n")
    assert code == 0, text
    meta = json.loads((out / "heads.meta.json").read_text())
    assert meta["means"]["corpus"] == ["-"] and meta["means"]["n_tokens"] == 14  # 2 × ([CLS] + words + [SEP])
