"""Head outputs (attnkit.cache_heads) and the modes patch and mean, against an eager implementation written here on a
plain transformers model: forward pre-hooks on each layer's output projection (`attention.output.dense`, whose input
is the heads' outputs side by side, B × L × H·D) read or replace a head's slice, and a small attention function
registered with transformers applies zero and no_inter to chosen heads. BERT and RoBERTa, text pairs, padded
batches; bad values refused with one line each."""
import copy

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, BertConfig, BertModel, RobertaConfig, RobertaModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import attnkit
from attnkit import AttnkitError, Intervention
from attnkit.interventions import StackedInterventions

from .test_ablation_tasks import tokenizer  # noqa: F401  (the fixture: a WordPiece tokenizer built in code)

H, D = 4, 8
PAIRS = [("a man is playing the guitar", "the dog is eating"), ("a cat", "a big red horse is riding on the river"),
         ("who is playing", "the child")]

# --- the eager implementation ----------------------------------------------------------------------------------
EAGER = {"zero": set(), "no_inter": set(), "sentences": None}  # heads (layer, head) and B × L sentence ids


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """softmax(q kᵀ · scaling + mask) · v, with EAGER's zero heads outputting 0 and its no_inter heads keeping only
    the weights to keys of the query's own sentence (not renormalised)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    w = torch.softmax(scores if attention_mask is None else scores + attention_mask, dim=-1)
    for layer, head in EAGER["no_inter"]:
        if layer == module.layer_idx:
            s = EAGER["sentences"]
            w[:, head] = w[:, head] * (s[:, :, None] == s[:, None, :])
    for layer, head in EAGER["zero"]:
        if layer == module.layer_idx:
            w[:, head] = 0.0
    return torch.matmul(w, value).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_eager_interventions", eager_attention)
AttentionMaskInterface.register("test_eager_interventions", eager_mask)  # the additive padding mask


def projections(model):
    return [layer.attention.output.dense for layer in model.encoder.layer]


def eager_run(model, enc, read=None, replace=None):
    """A forward of the plain model; `read`: dict filled with each layer's B × L × H × D head outputs; `replace`:
    {(layer, head): tensor broadcast to B × L × D} put in place of those heads' outputs."""
    handles = []
    for i, proj in enumerate(projections(model)):
        def hook(mod, args, i=i):
            x = args[0].view(*args[0].shape[:2], H, D).clone()
            for (layer, head), v in (replace or {}).items():
                if layer == i:
                    x[:, :, head] = v
            if read is not None:
                read[i] = x
            return (x.flatten(2),)
        handles.append(proj.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            return model(**enc).last_hidden_state
    finally:
        for h in handles:
            h.remove()


def make(kind, tok):
    torch.manual_seed(0)
    common = dict(vocab_size=tok.vocab_size, hidden_size=H * D, num_hidden_layers=3, num_attention_heads=H,
                  intermediate_size=64, attn_implementation="test_eager_interventions")
    if kind == "bert":
        plain = BertModel(BertConfig(max_position_embeddings=64, **common)).eval()
    else:
        cfg = RobertaConfig(max_position_embeddings=66, pad_token_id=0, bos_token_id=2, eos_token_id=3, **common)
        plain = RobertaModel(cfg).eval()
    return plain, attnkit.instrument(copy.deepcopy(plain), tok)


def encode(tok, kind, pairs=PAIRS):
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    if kind == "roberta":
        enc.pop("token_type_ids")
    return enc


@pytest.fixture(params=["bert", "roberta"])
def models(request, tokenizer):  # noqa: F811
    return request.param, *make(request.param, tokenizer)


def valid(enc):
    return enc["attention_mask"].bool()


def test_cached_outputs_are_the_heads_outputs(models, tokenizer):  # noqa: F811
    kind, plain, model = models
    enc = encode(tokenizer, kind)
    eager = {}
    eager_run(plain, enc, read=eager)
    with torch.no_grad(), attnkit.cache_heads(model) as cache:
        model(**enc)
    assert cache.keys() == [0, 1, 2]
    for layer in range(3):
        assert cache[layer].shape == (3, enc["input_ids"].shape[1], H, D) and not cache[layer].requires_grad
        torch.testing.assert_close(cache[layer][valid(enc)], eager[layer][valid(enc)], atol=2e-5, rtol=1e-4)
    with torch.no_grad(), attnkit.cache_heads(model, layers=[1]) as only:
        model(**enc)
    assert only.keys() == [1]
    with pytest.raises(AttnkitError, match="layer 0 is not cached: this cache keeps layers 1"):
        only[0]


def test_cache_keeps_gradients_when_asked(tokenizer):  # noqa: F811
    _, model = make("bert", tokenizer)
    enc = encode(tokenizer, "bert")
    with attnkit.cache_heads(model, layers=2, keep_grad=True) as cache:
        out = model(**enc).last_hidden_state
    (grad,) = torch.autograd.grad(out.sum(), cache[2])  # the output depends on the cached layer's heads
    assert grad.abs().sum() > 0


def test_caches_leave_in_any_order_and_on_ctrl_c(tokenizer):  # noqa: F811
    """A cache is in force from entering its block to leaving it, whatever the order blocks are left in; Ctrl-C
    inside a forward (KeyboardInterrupt from a forward hook on layer 1) detaches it, and it keeps what the layers
    before the interruption recorded (docs/interventions.md, "Blocks, threads and interruptions")."""
    import contextlib

    _, model = make("bert", tokenizer)
    enc, other = encode(tokenizer, "bert"), encode(tokenizer, "bert", PAIRS[::-1])
    first, second = contextlib.ExitStack(), contextlib.ExitStack()
    a = first.enter_context(attnkit.cache_heads(model, layers=[0]))
    b = second.enter_context(attnkit.cache_heads(model, layers=[2]))
    first.close()  # the outer block first
    with torch.no_grad():
        model(**enc)
    assert a.keys() == [] and b.keys() == [2]
    second.close()
    kept = b[2]
    with torch.no_grad():
        model(**other)
    assert a.keys() == [] and b[2] is kept  # neither records any more

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = model.encoder.layer[1].register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad(), attnkit.cache_heads(model) as cache:
            model(**enc)
    finally:
        handle.remove()
    assert cache.keys() == [0, 1]  # layer 1's attention ran before its hook raised
    kept = cache[1]
    with torch.no_grad(), attnkit.cache_heads(model) as again:
        model(**enc)
        model(**other)
    assert cache[1] is kept  # detached by the interruption
    with torch.no_grad(), attnkit.cache_heads(model) as once:
        model(**enc)
    assert torch.equal(once[1], kept) and not torch.equal(again[1], kept)


def test_patch_and_mean_equal_the_eager_replacement(models, tokenizer):  # noqa: F811
    kind, plain, model = models
    clean = encode(tokenizer, kind, [("a man is riding the horse", "the dog is eating")] * 2
                   + [("the city", "an old river")])
    corrupt = encode(tokenizer, kind, [("a woman is riding the horse", "the cat is eating")] * 2
                     + [("the tower", "a new river")])
    assert clean["input_ids"].shape == corrupt["input_ids"].shape
    with torch.no_grad(), attnkit.cache_heads(model) as cache:
        model(**clean)
    mean = torch.randn(D)
    one_sample = cache[1][0, :, 3]  # L × D: the same patch for every sample
    iv = (Intervention.for_model(model).set(0, 2, mode="patch", value=cache)
          .set(1, 3, mode="patch", value=one_sample).set(2, 0, mode="mean", value=mean)
          .set(2, 1, mode="patch", value=cache[2][:, :, 1]))
    with torch.no_grad(), attnkit.intervene(model, iv):
        got = model(**corrupt).last_hidden_state
    want = eager_run(plain, corrupt, replace={(0, 2): cache[0][:, :, 2], (1, 3): one_sample, (2, 0): mean,
                                              (2, 1): cache[2][:, :, 1]})
    torch.testing.assert_close(got[valid(corrupt)], want[valid(corrupt)], atol=2e-5, rtol=1e-4)
    base = eager_run(plain, corrupt)
    assert (got - base)[valid(corrupt)].abs().max() > 1e-3  # the patches changed the output


def test_whole_layer_values_and_features_of_patched_heads(tokenizer):  # noqa: F811
    """A layer of the cache patches every head of that layer; the features of a patched head describe the weights
    it computed (as the unpatched head's)."""
    plain, model = make("bert", tokenizer)
    enc = encode(tokenizer, "bert")
    with torch.no_grad(), attnkit.cache_heads(model) as cache:
        model(**enc)
    other = encode(tokenizer, "bert", [("a", "b"), ("c", "d"), ("e", "f")])
    other = {k: v[:, :1].repeat(1, enc["input_ids"].shape[1]) for k, v in other.items()}  # same length
    iv = Intervention.for_model(model).set(1, mode="patch", value=cache[1]).set(0, mode="mean",
                                                                                value=torch.ones(H, D))
    with torch.no_grad(), attnkit.intervene(model, iv):
        got = model(**other).last_hidden_state
    want = eager_run(plain, other, replace={**{(1, h): cache[1][:, :, h] for h in range(H)},
                                            **{(0, h): torch.ones(D) for h in range(H)}})
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    texts = ["a man is playing .", ("the dog", "is eating .")]
    patched = Intervention.for_model(model).set(1, 2, mode="mean", value=torch.full((D,), 5.0))
    with attnkit.intervene(model, patched):
        f_patched = attnkit.extract(texts, (model, tokenizer), backend="fused", max_length=32)
    f_plain = attnkit.extract(texts, (model, tokenizer), backend="fused", max_length=32)
    np.testing.assert_allclose(f_patched.mean[1, 2], f_plain.mean[1, 2], atol=1e-6)  # layer 1's weights unchanged
    assert np.abs(f_patched.mean[2] - f_plain.mean[2]).max() > 1e-4  # later layers see the patch


def test_combined_with_zero_and_regions_on_other_heads(tokenizer):  # noqa: F811
    plain, model = make("bert", tokenizer)
    enc = encode(tokenizer, "bert")
    with torch.no_grad(), attnkit.cache_heads(model) as cache:
        model(**encode(tokenizer, "bert", [("a man is playing the guitar", "the cat is eating")] + PAIRS[1:]))
    mean = torch.randn(D)
    iv = (Intervention.for_model(model).set(0, 1, mode="zero").set(1, 0, region="no_inter")
          .set(1, 2, mode="mean", value=mean).set(2, 3, mode="patch", value=cache).set(2, 0, mode="zero"))
    with torch.no_grad(), attnkit.intervene(model, iv):
        got = model(**enc).last_hidden_state
    # the eager sentences: segment A with [CLS] and its [SEP] is sentence 0, segment B with the last [SEP] sentence 1
    EAGER.update(zero={(0, 1), (2, 0)}, no_inter={(1, 0)}, sentences=enc["token_type_ids"])
    try:
        want = eager_run(plain, enc, replace={(1, 2): mean, (2, 3): cache[2][:, :, 3]})
        EAGER.update(no_inter=set())
        without_region = eager_run(plain, enc, replace={(1, 2): mean, (2, 3): cache[2][:, :, 3]})
    finally:
        EAGER.update(zero=set(), no_inter=set(), sentences=None)
    torch.testing.assert_close(got[valid(enc)], want[valid(enc)], atol=2e-5, rtol=1e-4)
    assert (want - without_region)[valid(enc)].abs().max() > 1e-4  # the region mattered


def test_stacked_interventions_equal_one_forward_each(tokenizer):  # noqa: F811
    _, model = make("bert", tokenizer)
    enc = encode(tokenizer, "bert")
    with torch.no_grad(), attnkit.cache_heads(model) as cache:
        model(**enc)
    ivs = [Intervention.for_model(model), Intervention.for_model(model).set(1, 2, mode="zero"),
           Intervention.for_model(model).set(1, 0, region="no_inter").set(0, 3, mode="uniform"),
           Intervention.for_model(model).set(2, 1, mode="patch", value=cache[2][:, :, 0])]
    alone = []
    with torch.no_grad():
        for iv in ivs:
            with attnkit.intervene(model, iv):
                alone.append(model(**enc).last_hidden_state)
        with attnkit.intervene(model, StackedInterventions(ivs, 3)):
            stacked = model(**{k: v.repeat(4, 1) for k, v in enc.items()}).last_hidden_state
        for i, a in enumerate(alone):
            torch.testing.assert_close(stacked[3 * i:3 * i + 3], a, atol=1e-6, rtol=1e-6)
        with pytest.raises(AttnkitError, match="4 stacked interventions of 3 samples each need a batch of 12, but "
                                               "the forward has 3"), attnkit.intervene(model,
                                                                                       StackedInterventions(ivs, 3)):
            model(**enc)


def test_bad_values_are_refused_with_one_line(tokenizer):  # noqa: F811
    _, model = make("bert", tokenizer)
    enc = encode(tokenizer, "bert")
    with torch.no_grad(), attnkit.cache_heads(model) as cache:
        model(**enc)
    iv = Intervention.for_model(model)
    cases = [
        (lambda: iv.set(0, 1, mode="mean", value=torch.zeros(2, D)), r"mean value of L0H1 must have shape D \(the "
                                                                      r"head size\), got \(2, 8\)"),
        (lambda: iv.set(0, 1, mode="patch", value=torch.zeros(D)), r"must have shape L × D or B × L × D"),
        (lambda: iv.set(0, mode="patch", value=torch.zeros(5, 3, D)), r"L × H × D \(H = 4\)"),
        (lambda: iv.set(0, 1, mode="mean", value=torch.tensor([0.0] * 7 + [float("nan")])), "holds NaN"),
        (lambda: iv.set(0, 1, mode="patch", value=torch.full((5, D), float("inf"))), "holds an infinite number"),
        (lambda: iv.set(0, 1, mode="mean", value=torch.zeros(D, dtype=torch.long)), "must hold floats"),
        (lambda: iv.set(0, 1, mode="mean"), "mode 'mean' needs a value for L0H1"),
        (lambda: iv.set(0, 1, mode="zero", value=torch.zeros(D)), "value is for modes patch and mean"),
        (lambda: iv.set(0, 1, mode="mean", value=cache), "not a cache"),
    ]
    for call, message in cases:
        with pytest.raises(AttnkitError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
    shorter = encode(tokenizer, "bert", [("a man", "a dog")])
    forwards = [
        (Intervention.for_model(model).set(0, 1, mode="patch", value=cache), shorter,
         r"the patch value of L0H1 covers \d+ tokens but the forward has \d+: patch between inputs of equal token"),
        (Intervention.for_model(model).set(2, 0, mode="patch", value=cache[2][:2, :, 0]), enc,
         "the patch value of L2H0 holds 2 samples but the forward has 3"),
        (Intervention.for_model(model).set(1, 1, mode="mean", value=torch.zeros(3)), enc,
         "the mean value of L1H1 has 3 numbers per token but the head outputs 8"),
    ]
    for iv, inputs, message in forwards:
        with pytest.raises(AttnkitError, match=message) as err, torch.no_grad(), attnkit.intervene(model, iv):
            model(**inputs)
        assert "\n" not in str(err.value)
    with pytest.raises(AttnkitError, match="holds no outputs of layer 0 yet"):
        empty = attnkit.cache_heads(model)
        with empty as c:
            pass
        c[0]
    with pytest.raises(AttnkitError, match="layers must be layer numbers 0 … 2, got 3"):
        with attnkit.cache_heads(model, layers=[3]):
            pass
