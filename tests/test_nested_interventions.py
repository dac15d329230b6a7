"""Nested `attnkit.intervene` blocks compose (docs/interventions.md, "Nested blocks"): the inner block adds its
settings to the enclosing one's, and the forward equals that of the merged intervention, written out by hand here
and applied at once, on a tiny BERT (text pairs, padding) and a tiny left-padded Llama: modes, regions,
renormalize, gates, mean ablation, patching, head caches, stacked interventions and given sentence ids. A head both
blocks set differently is refused by name, and leaving the inner block restores exactly the outer state, also after
an exception or a refusal."""
from __future__ import annotations

import copy

import pytest
import torch

import attnkit
from attnkit import AttnkitError, Intervention
from attnkit.engine.forward import forward_features, measuring
from attnkit.interventions import StackedInterventions
from attnkit.models import runtime_of
from attnkit.tokens import Batch

from .synthetic import padded_inputs, tiny_decoder, tiny_encoder

LENGTHS = [9, 7, 5]


@pytest.fixture(scope="module")
def bert():
    model = attnkit.instrument(tiny_encoder("bert", n_layers=3))
    return model, padded_inputs(120, LENGTHS, pair=True)


@pytest.fixture(scope="module")
def llama():
    model = attnkit.instrument(copy.deepcopy(tiny_decoder("llama", n_layers=3)))
    enc = padded_inputs(120, LENGTHS)
    enc["input_ids"][0, 4] = 2  # an EOS inside sample 0: two segments, so regions act
    mask = enc["attention_mask"].flip(1)  # left padding, as generate pads decoders
    ids = torch.zeros_like(enc["input_ids"])
    for b, n in enumerate(LENGTHS):
        ids[b, -n:] = enc["input_ids"][b, :n]
    return model, {"input_ids": ids, "attention_mask": mask}


def forward(model, enc):
    """The model's output (logits or last hidden state) at the valid tokens, and its maps."""
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    valid = enc["attention_mask"].bool()
    main = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return main[valid], torch.stack([a for a in out.attentions])


def nested(model, enc, outer, inner, **kw):
    with attnkit.intervene(model, outer, **kw), attnkit.intervene(model, inner):
        return forward(model, enc)


def at_once(model, enc, iv, **kw):
    with attnkit.intervene(model, iv, **kw):
        return forward(model, enc)


def assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def assert_differ(a, b):
    assert (a[0] - b[0]).abs().max() > 1e-3


def shape(model):
    return (model.config.num_hidden_layers, model.config.num_attention_heads)


@pytest.fixture(params=["bert", "llama"])
def case(request, bert, llama):
    return bert if request.param == "bert" else llama


def test_the_issues_example_an_inner_head_no_longer_undoes_the_outer_layer(case):
    """Zeroing layer 1 outside and one head inside: before, the inner block replaced the outer one."""
    model, enc = case
    outer = Intervention.from_layers(model, 1, mode="zero")
    inner = Intervention.from_heads(model, "L2H3", mode="zero")
    want = Intervention.from_heads(model, "L1,L2H3", mode="zero")
    got = nested(model, enc, outer, inner)
    assert_same(got, at_once(model, enc, want))
    assert_differ(got, at_once(model, enc, inner))


def test_modes_regions_and_renormalize_merge_per_head(case):
    model, enc = case
    outer = Intervention.from_heads(model, "L0H1", mode="keep", region="no_inter", renormalize=True)
    outer.set(1, 2, mode="uniform")
    inner = Intervention.from_heads(model, "L0H1,L2H0", mode="zero")  # L0H1: the mode of a head outer gave a region
    inner.set(1, 0, mode="keep", region="no_intra")
    inner.renormalize = True
    want = Intervention.identity(*shape(model))
    want.renormalize = True
    want.set(0, 1, mode="zero", region="no_inter").set(1, 2, mode="uniform").set(2, 0, mode="zero")
    want.set(1, 0, mode="keep", region="no_intra")
    assert_same(nested(model, enc, outer, inner), at_once(model, enc, want))
    # renormalize comes from the block that has regions: an inner block without regions keeps the outer's
    plain_inner = Intervention.from_heads(model, "L2H0", mode="zero")
    want = Intervention.from_heads(model, "L0H1", mode="keep", region="no_inter", renormalize=True).set(2, 0, mode="zero")
    assert_same(nested(model, enc, outer.copy().set(1, 2), plain_inner), at_once(model, enc, want))
    unnormalized = Intervention.from_heads(model, "L0H1", mode="keep", region="no_inter", renormalize=False)
    assert_differ(at_once(model, enc, want), at_once(model, enc, unnormalized.set(2, 0, mode="zero")))


def test_gates_multiply_and_both_get_gradients(case):
    model, enc = case
    g_out = torch.rand(shape(model), generator=torch.Generator().manual_seed(0)) + 0.5
    g_in = torch.rand(shape(model), generator=torch.Generator().manual_seed(1)) + 0.5
    outer = Intervention.from_heads(model, "L0H2", mode="zero").with_gates(g_out)
    inner = Intervention.from_heads(model, "L1H1", mode="uniform").with_gates(g_in)
    want = Intervention.from_heads(model, "L0H2", mode="zero").set(1, 1, mode="uniform").with_gates(g_out * g_in,
                                                                                                    requires_grad=False)
    assert_same(nested(model, enc, outer, inner), at_once(model, enc, want))
    with attnkit.intervene(model, outer), attnkit.intervene(model, inner), torch.enable_grad():
        out = model(**enc)
        (out.logits if hasattr(out, "logits") else out.last_hidden_state).sum().backward()
    assert outer.gates.grad is not None and inner.gates.grad is not None
    torch.testing.assert_close(outer.gates.grad * g_out, inner.gates.grad * g_in, atol=1e-4, rtol=1e-4)


def test_mean_ablation_and_patching_compose_with_other_heads(case):
    model, enc = case
    L, H = shape(model)
    D = model.config.hidden_size // H
    means = torch.randn(L, H, D, generator=torch.Generator().manual_seed(2))
    with attnkit.cache_heads(model) as clean, torch.no_grad():
        model(**{**enc, "input_ids": enc["input_ids"].flip(0), "attention_mask": enc["attention_mask"]})
    outer = Intervention.from_heads(model, "L0H0,L2", mode="mean", means=means)
    inner = Intervention.for_model(model).set(1, 3, mode="patch", value=clean).set(0, 1, mode="zero")
    want = Intervention.from_heads(model, "L0H0,L2", mode="mean", means=means)
    want.set(1, 3, mode="patch", value=clean).set(0, 1, mode="zero")
    got = nested(model, enc, outer, inner)
    assert_same(got, at_once(model, enc, want))
    assert_differ(got, at_once(model, enc, inner))
    # the same value on the same head in both blocks is no conflict
    again = Intervention.from_heads(model, "L0H0", mode="mean", means=means)
    assert_same(nested(model, enc, outer, again), at_once(model, enc, outer))


def test_head_caches_record_the_merged_outputs(case):
    model, enc = case
    outer = Intervention.from_heads(model, "L0H1", mode="zero")
    inner = Intervention.from_heads(model, "L1H2", mode="uniform")
    want = Intervention.from_heads(model, "L0H1", mode="zero").set(1, 2, mode="uniform")
    with attnkit.intervene(model, outer), attnkit.cache_heads(model) as got, attnkit.intervene(model, inner), \
            torch.no_grad():
        model(**enc)
    with attnkit.intervene(model, want), attnkit.cache_heads(model) as expected, torch.no_grad():
        model(**enc)
    for layer in range(shape(model)[0]):
        torch.testing.assert_close(got[layer], expected[layer], atol=1e-5, rtol=1e-5)
    assert float(got[0][:, :, 1].abs().max()) == 0.0


def test_stacked_interventions_take_the_enclosing_settings_into_each(case):
    model, enc = case
    B = enc["input_ids"].shape[0]
    twice = {k: torch.cat([v, v]) for k, v in enc.items()}
    outer = Intervention.from_heads(model, "L0H3", mode="zero")
    a, b = Intervention.from_heads(model, "L1H0", mode="uniform"), Intervention.from_heads(model, "L2H1", mode="zero")
    got = nested(model, twice, outer, StackedInterventions([a, b], B))
    merged = [Intervention.from_heads(model, "L0H3", mode="zero").set(1, 0, mode="uniform"),
              Intervention.from_heads(model, "L0H3,L2H1", mode="zero")]
    assert_same(got, at_once(model, twice, StackedInterventions(merged, B)))
    n = int(enc["attention_mask"].sum())
    for i, iv in enumerate(merged):
        torch.testing.assert_close(got[0][i * n:(i + 1) * n], at_once(model, enc, iv)[0], atol=1e-5, rtol=1e-5)
    # a plain intervention inside a stack goes into each of its settings
    got = nested(model, twice, StackedInterventions([a, b], B), outer)
    assert_same(got, at_once(model, twice, StackedInterventions(merged, B)))
    with attnkit.intervene(model, StackedInterventions([a, b], B)):
        with pytest.raises(AttnkitError, match="stacked interventions cannot be nested in stacked interventions"):
            with attnkit.intervene(model, StackedInterventions([b, a], B)):
                pass


def test_given_sentences_hold_for_the_inner_block_and_other_ids_are_refused(bert):
    model, enc = bert
    ids = torch.zeros_like(enc["input_ids"], dtype=torch.int32)
    ids[:, 3:] = 1
    outer = Intervention.from_heads(model, "L0H0", mode="zero")
    inner = Intervention.from_heads(model, "L1H1", mode="keep", region="no_inter")
    want = Intervention.from_heads(model, "L0H0", mode="zero").set(1, 1, mode="keep", region="no_inter")
    got = nested(model, enc, outer, inner, sentences=ids)
    assert_same(got, at_once(model, enc, want, sentences=ids))
    assert_differ(got, at_once(model, enc, want))  # the token_type_ids split elsewhere: the given ids were used
    with attnkit.intervene(model, outer, sentences=ids):
        with attnkit.intervene(model, inner, sentences=ids.clone()):  # the same ids again: fine
            assert_same(forward(model, enc), got)
        with pytest.raises(AttnkitError, match="sentence ids are already given by an enclosing block"):
            with attnkit.intervene(model, inner, sentences=1 - ids):
                pass
        with pytest.raises(AttnkitError, match="sentence ids are already given by an enclosing block"):
            with attnkit.sentences(model, 1 - ids):
                pass
        assert torch.equal(runtime_of(model).sentences, ids)
    assert runtime_of(model).sentences is None


def test_two_settings_of_one_head_are_refused_by_name(case):
    model, enc = case
    outer = Intervention.from_heads(model, "L1", mode="zero")
    with attnkit.intervene(model, outer):
        with pytest.raises(AttnkitError, match=r"both set the mode of head L1H2: zero in the enclosing block, "
                                               r"uniform in the inner one"):
            with attnkit.intervene(model, Intervention.from_heads(model, "L1H2", mode="uniform")):
                pass
        with attnkit.intervene(model, Intervention.from_heads(model, "L1H2", mode="zero")):  # the same: fine
            assert_same(forward(model, enc), at_once(model, enc, outer))
    H = shape(model)[1]
    D = model.config.hidden_size // H
    m1, m2 = torch.zeros(D), torch.ones(D)
    with attnkit.intervene(model, Intervention.for_model(model).set(0, 0, mode="mean", value=m1)):
        with pytest.raises(AttnkitError, match="head L0H0: mean in the enclosing block, mean with another value"):
            with attnkit.intervene(model, Intervention.for_model(model).set(0, 0, mode="mean", value=m2)):
                pass
    with attnkit.intervene(model, Intervention.from_heads(model, "L0H0", mode="keep", region="no_intra")):
        with pytest.raises(AttnkitError, match="both set the region of head L0H0: no_intra in the enclosing block, "
                                               "no_inter in the inner one"):
            with attnkit.intervene(model, Intervention.from_heads(model, "L0H0", mode="keep", region="no_inter")):
                pass
    with attnkit.intervene(model, Intervention.from_heads(model, "L0H0", mode="keep", region="no_intra")):
        with pytest.raises(AttnkitError, match="both have region settings but differ in renormalize"):
            with attnkit.intervene(model, Intervention.from_heads(model, "L0H1", mode="keep", region="no_intra",
                                                                  renormalize=True)):
                pass


def test_leaving_the_inner_block_restores_the_outer_state_exactly(case):
    model, enc = case
    rt = runtime_of(model)
    outer = Intervention.from_heads(model, "L0H1", mode="zero")
    alone = at_once(model, enc, outer)
    with attnkit.intervene(model, outer):
        assert rt.intervention is outer
        with pytest.raises(RuntimeError, match="boom"):
            with attnkit.intervene(model, Intervention.from_heads(model, "L2H2", mode="uniform")):
                raise RuntimeError("boom")
        assert rt.intervention is outer
        with pytest.raises(AttnkitError, match="head L0H1"):  # refused on entry: nothing changed
            with attnkit.intervene(model, Intervention.from_heads(model, "L0H1", mode="uniform")):
                pass
        assert rt.intervention is outer
        with attnkit.intervene(model, Intervention.from_heads(model, "L2H2", mode="uniform")):
            pass
        assert rt.intervention is outer
        assert_same(forward(model, enc), alone)
    assert rt.intervention is None


def test_features_of_a_nested_forward_equal_the_merged_ones(llama):
    model, enc = llama
    mask = enc["attention_mask"].flip(1)  # attnkit's own batches are right-padded
    ids = torch.stack([r.roll(int(n)) for r, n in zip(enc["input_ids"], mask.sum(-1))])
    n = len(LENGTHS)
    batch = Batch({"input_ids": ids, "attention_mask": mask}, mask.sum(-1), torch.zeros(ids.shape, dtype=torch.int32),
                  (ids == 2).cumsum(-1).int(), 0)
    outer = Intervention.from_heads(model, "L0H0", mode="keep", region="no_intra", renormalize=True)
    inner = Intervention.from_heads(model, "L1H2,L2H3", mode="uniform")
    want = Intervention.from_heads(model, "L0H0", mode="keep", region="no_intra", renormalize=True)
    want.set(1, 2, mode="uniform").set(2, 3, mode="uniform")
    with measuring(model, num_windows=4):
        with attnkit.intervene(model, outer), attnkit.intervene(model, inner):
            got = forward_features(model, batch)
        with attnkit.intervene(model, want):
            expected = forward_features(model, batch)
        with attnkit.intervene(model, inner):
            inner_only = forward_features(model, batch)
    assert got.shape[0] == n
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert (got[:, 0, 0] - inner_only[:, 0, 0]).abs().max() > 1e-3


def test_ablation_runners_evaluate_exactly_their_settings(bert):
    """attnkit's ablation runners put exactly their setting in force (attnkit.interventions.only), so an enclosing
    block changes neither a sweep's settings nor its baseline."""
    from attnkit.interventions import only

    model, enc = bert
    iv = Intervention.from_heads(model, "L1H1", mode="zero")
    with attnkit.intervene(model, Intervention.from_heads(model, "L0", mode="uniform")):
        with only(model, iv):
            got = forward(model, enc)
    assert_same(got, at_once(model, enc, iv))


def test_blocks_left_out_of_order_leave_the_model_as_it_was(case):
    """Issue 46: the outer block left first (an ExitStack per block, or `__exit__` by hand) used to leave its
    intervention on the model. What is in force follows from the blocks still open, in the order they were entered."""
    import contextlib

    model, enc = case
    rt = runtime_of(model)
    plain = forward(model, enc)
    a = Intervention.from_heads(model, "L0H1", mode="zero")
    b = Intervention.from_heads(model, "L2H2", mode="uniform")
    outer, inner = contextlib.ExitStack(), contextlib.ExitStack()
    outer.enter_context(attnkit.intervene(model, a))
    inner.enter_context(attnkit.intervene(model, b))
    outer.close()  # the outer block first
    assert_same(forward(model, enc), at_once(model, enc, b))  # the inner block's settings alone
    inner.close()
    assert rt.intervention is None and attnkit.interventions.open_blocks(model) == 0
    assert_same(forward(model, enc), plain)

    # three blocks by hand, the middle one left first: the other two compose as if it had never been entered
    c = Intervention.from_heads(model, "L1H0", mode="zero")
    blocks = [attnkit.intervene(model, iv) for iv in (a, b, c)]
    for blk in blocks:
        blk.__enter__()
    blocks[1].__exit__(None, None, None)
    want = Intervention.from_heads(model, "L0H1", mode="zero").set(1, 0, mode="zero")
    assert_same(forward(model, enc), at_once(model, enc, want))
    blocks[2].__exit__(None, None, None)
    assert rt.intervention is a  # leaving the innermost block: exactly what was in force when it was entered
    blocks[0].__exit__(None, None, None)
    assert rt.intervention is None
    assert_same(forward(model, enc), plain)


def test_blocks_left_out_of_order_keep_only_and_sentences_straight(bert):
    """`only` blocks and given sentence ids follow the same rule: an `only` block left before a block entered inside
    it lets that block compose with what is outside; ids stay while a block that gave them is open."""
    from attnkit.interventions import only

    model, enc = bert
    rt = runtime_of(model)
    a = Intervention.from_heads(model, "L0H1", mode="zero")
    x = Intervention.from_heads(model, "L1H1", mode="uniform")
    c = Intervention.from_heads(model, "L2H0", mode="zero")
    blocks = [attnkit.intervene(model, a), only(model, x), attnkit.intervene(model, c)]
    for blk in blocks:
        blk.__enter__()
    assert_same(forward(model, enc), at_once(model, enc, Intervention.from_heads(model, "L1H1", mode="uniform")
                                             .set(2, 0, mode="zero")))
    blocks[1].__exit__(None, None, None)
    assert_same(forward(model, enc), at_once(model, enc, Intervention.from_heads(model, "L0H1", mode="zero")
                                             .set(2, 0, mode="zero")))
    blocks[0].__exit__(None, None, None)
    blocks[2].__exit__(None, None, None)
    assert rt.intervention is None

    ids = torch.zeros(enc["input_ids"].shape, dtype=torch.int32)
    given, inner = attnkit.sentences(model, ids), attnkit.intervene(model, a, sentences=ids)
    given.__enter__()
    inner.__enter__()
    given.__exit__(None, None, None)
    assert torch.equal(rt.sentences, ids)  # the inner block gave them too
    inner.__exit__(None, None, None)
    assert rt.sentences is None and rt.intervention is None and attnkit.interventions.open_blocks(model) == 0


def test_blocks_that_no_longer_compose_after_an_out_of_order_exit_are_closed_by_name(bert):
    """Leaving a block recomposes the blocks entered after it from their Interventions as they are now; one changed in
    place to set a head an outer block sets is refused as on entry, and those blocks close, the model keeping what
    was in force before them."""
    model, enc = bert
    rt = runtime_of(model)
    a = Intervention.from_heads(model, "L0H1", mode="zero")
    c = Intervention.from_heads(model, "L1H0", mode="zero")
    blocks = [attnkit.intervene(model, iv) for iv in (a, Intervention.from_heads(model, "L2H2", mode="zero"), c)]
    for blk in blocks:
        blk.__enter__()
    c.set(0, 1, mode="uniform")
    with pytest.raises(AttnkitError, match="no longer compose.*head L0H1: zero in the enclosing block, uniform"):
        blocks[1].__exit__(None, None, None)
    assert rt.intervention is a and attnkit.interventions.open_blocks(model) == 1
    blocks[2].__exit__(None, None, None)  # already closed: nothing to do
    assert rt.intervention is a
    blocks[0].__exit__(None, None, None)
    assert rt.intervention is None and attnkit.interventions.open_blocks(model) == 0


def test_blocks_are_the_models_state_in_every_thread_and_a_copy_has_its_own(bert):
    """Issue 47: `intervene`, `sentences` and `cache_heads` blocks are state of the model, as `model.eval()` is: a
    block open in one thread applies to the forwards other threads run, blocks of two threads compose and may be left
    in any order, and a deep copy of the model (made outside any block) is untouched by the original's blocks.
    The threads take turns through events, so the order is fixed."""
    import threading

    model, enc = bert
    twin = copy.deepcopy(model)
    a = Intervention.from_heads(model, "L0H1", mode="zero")
    b = Intervention.from_heads(model, "L2H2", mode="uniform")
    plain, want_a, want_b = forward(model, enc), at_once(model, enc, a), at_once(model, enc, b)
    want_ab = at_once(model, enc, Intervention.from_heads(model, "L0H1", mode="zero").set(2, 2, mode="uniform"))
    entered, leave, caught = threading.Event(), threading.Event(), []

    def other_thread():
        with attnkit.intervene(model, a), attnkit.cache_heads(model, layers=[1]) as cache:
            entered.set()
            assert leave.wait(60)
        caught.append(cache)

    worker = threading.Thread(target=other_thread)
    worker.start()
    assert entered.wait(60)
    assert_same(forward(model, enc), want_a)  # the other thread's block applies to this thread's forward
    assert_same(forward(twin, enc), plain)  # not to a copy
    with attnkit.intervene(model, b):
        assert_same(forward(model, enc), want_ab)  # the two threads' blocks compose
        leave.set()
        worker.join(60)
        assert not worker.is_alive()
        assert_same(forward(model, enc), want_b)  # the other thread left first: this block's settings alone
    assert_same(forward(model, enc), plain)
    assert caught[0][1].shape[:2] == enc["input_ids"].shape  # the cache recorded this thread's forwards
    assert runtime_of(model).intervention is None and attnkit.interventions.open_blocks(model) == 0
