"""A tiny BERT trained to copy the previous token: disabling the heads that attend to the previous token
must destroy it, disabling any other head must not, and gradient importance must rank those heads first."""
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForTokenClassification

import attnkit
from attnkit.ablation import head_importance, run_experiment
from attnkit.engine import measuring
from attnkit.features import feature_names
from attnkit.hf_attention import BatchInfo

V, L, N_SPECIAL = 10, 8, 3  # symbols 3..12; id 1 starts every sequence


def _data(n, gen):
    x = torch.randint(N_SPECIAL, N_SPECIAL + V, (n, L), generator=gen)
    x[:, 0] = 1
    y = torch.full_like(x, -100)
    y[:, 2:] = x[:, 1:-1]  # predict the previous symbol (position 1 has only the start token before it)
    return x, y


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=V + N_SPECIAL, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=L, num_labels=V + N_SPECIAL, type_vocab_size=1,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = BertForTokenClassification(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few hundred tiny steps: one thread is fastest on a shared machine
    try:
        _train(model, opt, gen)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    attnkit.instrument(model)
    x, y = _data(256, torch.Generator().manual_seed(1))
    return model, x, y


def _train(model, opt, gen):
    for _ in range(1000):
        x, y = _data(64, gen)
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        # stop once it has learned the task but before the loss saturates: at a near-zero loss every
        # gradient, hence every importance score, is ~0 and their ranking is noise
        if loss.item() < 0.3:
            break


def _accuracy(model, x, y, iv=None):
    iv = iv or attnkit.Intervention.for_model(model)
    with torch.no_grad(), attnkit.intervene(model, iv):
        pred = model(input_ids=x).logits.argmax(-1)
    m = y != -100
    return float((pred[m] == y[m]).float().mean())


def _prev_scores(model, x):
    """Mean attention to the previous token per head, measured by attnkit."""
    n = len(feature_names())
    prev = feature_names().index("prev")
    with measuring(model, backend="reference") as rt, \
            rt.batch_of(BatchInfo(torch.full((x.shape[0],), L), torch.zeros_like(x, dtype=torch.int32), None)):
        with torch.no_grad():
            model(input_ids=x)
        feats = torch.stack([rt.features[i] for i in range(2)], 1).mean(0)  # layers × heads × F
    assert feats.shape[-1] == n
    return feats[..., prev].numpy()


def test_previous_token_heads_carry_the_task(trained):
    model, x, y = trained
    base = _accuracy(model, x, y)
    assert base > 0.95, f"the tiny model did not learn the task ({base:.3f})"
    prev = _prev_scores(model, x)
    carriers = [tuple(map(int, lh)) for lh in zip(*np.nonzero(prev > 0.5))]
    assert carriers, f"no head attends to the previous token: {prev.round(2)}"
    assert len(carriers) < prev.size
    # zeroing the carriers destroys the task (chance is 1/V)
    broken = _accuracy(model, x, y, attnkit.Intervention.from_heads(model, carriers, mode="zero"))
    assert broken < base - 0.5, (carriers, broken)

    # zeroing any single other head leaves it working (the heads experiment: one head at a time)
    def evaluate(iv):
        return {"accuracy": 100 * _accuracy(model, x, y, iv)}

    table = run_experiment("heads", model, evaluate, "accuracy", mode="zero", progress=False)
    assert table.rows[0]["setting"] == "baseline" and table.rows[0]["delta_accuracy"] == 0
    assert len(table.rows) == 1 + prev.size
    for r in table.rows[1:]:
        if (r["layer"], r["head"]) not in carriers:
            assert r["delta_accuracy"] > -15, r
    layers = run_experiment("layers", model, evaluate, "accuracy", mode="uniform", progress=False)
    carrier_layers = {l for l, _ in carriers}
    worst = min(layers.rows[1:], key=lambda r: r["delta_accuracy"])
    assert worst["layer"] in carrier_layers and worst["delta_accuracy"] < -50

    # gradient importance (per example, as Michel et al. define it) ranks the carriers first
    def losses():
        for i in range(96):
            logits = model(input_ids=x[i:i + 1]).logits
            yield torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i:i + 1].reshape(-1))

    imp = head_importance(model, losses, normalize_layers=False)
    assert imp["n"] == 96
    order = [tuple(map(int, np.unravel_index(f, prev.shape))) for f in np.argsort(-imp["raw"], axis=None)]
    assert set(order[: len(carriers)]) == set(carriers), (order, carriers, imp["raw"].round(4))
    # a pruned head gets zero importance (its gate no longer matters)
    few = lambda: (torch.nn.functional.cross_entropy(model(input_ids=x[i:i + 4]).logits.reshape(-1, V + N_SPECIAL),
                                                     y[i:i + 4].reshape(-1)) for i in (0, 4))
    masked = head_importance(model, few, attnkit.Intervention.from_heads(model, carriers[:1]), normalize_layers=False)
    assert masked["n"] == 2
    assert masked["raw"][carriers[0]] == 0
