"""Region interventions (no_intra / no_inter) in plain forwards, `model(**tokenizer(...))` inside
`attnkit.intervene`: sentences come from token_type_ids, from separator tokens, or from the user, and
the result equals an eager attention written here that removes the region's weights itself. Where no
sentence structure can be found the forward is refused. Also Intervention's repr."""
import copy

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    RobertaConfig,
    RobertaModel,
)
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import attnkit
from attnkit.errors import AttnkitError
from attnkit.models import default_model_path, runtime_of
from attnkit.tokens import Encoder

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
QUESTIONS = ["Where did the cat sit?", "Do rivers bend?"]
CONTEXTS = ["The cat sat on the mat, and the dog slept.", "Rivers bend. Lakes form where the bend is cut!"]
SINGLE = ["Bread needs time, water, salt, flour and yeast.", "Short one."]
# layer -> region per head: some heads changed in both layers, the others left alone
PLAN = {0: ["R", "R", "all", "all"], 1: ["all", "all", "all", "R"]}

# --- an eager attention that applies the region itself ------------------------------------------------
EAGER = "test_region_eager"
_reference = {"regions": None, "sentences": None, "renormalize": False}


def eager_region_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scores = query @ key.transpose(-1, -2) * scaling
    if attention_mask is not None:  # 2-D padding mask (flash_attention_mask)
        scores = scores.masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf"))
    weights = scores.softmax(-1)
    regions = _reference["regions"]
    if regions is not None:
        heads = regions[module.layer_idx]
        sid = _reference["sentences"]
        same = (sid[:, :, None] == sid[:, None, :])[:, None]  # B×1×L×L
        no_intra = torch.tensor([r == "no_intra" for r in heads])[None, :, None, None]
        no_inter = torch.tensor([r == "no_inter" for r in heads])[None, :, None, None]
        weights = weights.masked_fill((no_intra & same) | (no_inter & ~same), 0.0)
        if _reference["renormalize"]:
            total = weights.sum(-1, keepdim=True)
            weights = torch.where(total > 0, weights / total.clamp_min(1e-30), weights)  # empty rows stay 0
    return (weights @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(EAGER, eager_region_attention)
AttentionMaskInterface.register(EAGER, flash_attention_mask)


def eager_reference(model, inputs, region, sentences, renormalize):
    """Outputs of `model` (an uninstrumented copy) with `region` on the PLAN heads, sentences given."""
    regions = None if region is None else {l: [region if r == "R" else r for r in rs] for l, rs in PLAN.items()}
    _reference.update(regions=regions, sentences=sentences, renormalize=renormalize)
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        _reference.update(regions=None, sentences=None, renormalize=False)


def plan_intervention(model, region, renormalize):
    iv = attnkit.Intervention.for_model(model)
    iv.renormalize = renormalize
    for layer, heads in PLAN.items():
        iv.set_heads([(layer, h) for h, r in enumerate(heads) if r == "R"], region=region)
    return iv


def twins(model, tokenizer=None):
    """(instrumented model, the same weights with the eager region attention)."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(EAGER)
    return attnkit.instrument(model, tokenizer), reference


def segment_sentences(enc) -> torch.Tensor:
    """Expected sentence ids, from the tokenizer's own segment marks: 1 from the second segment's first
    token on (so [CLS] and the first segment's separators are in sentence 0, the last [SEP] in 1)."""
    out = torch.zeros_like(enc["input_ids"])
    for b in range(out.shape[0]):
        second = False
        for t, seq in enumerate(enc.sequence_ids(b)):
            second = second or seq == 1
            out[b, t] = int(second)
    return out


def max_diff(a, b, mask):
    return (a - b)[mask.bool()].abs().max().item()


@pytest.fixture(scope="module")
def bert_tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def tiny_bert(tokenizer, cls=BertModel, **extra):
    torch.manual_seed(0)
    return cls(BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=64, **TINY, **extra)).eval()


def tiny_roberta(tokenizer):
    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, **TINY)
    return RobertaModel(cfg).eval()


def region_matches_eager(model, reference, enc, region, renormalize, sentences):
    """Run `enc` plainly and under the region intervention; the intervened hidden states must equal the eager
    reference's to 1e-5. Returns (intervened, plain, attention mask)."""
    mask = enc["attention_mask"]
    iv = plan_intervention(model, region, renormalize)
    with torch.no_grad():
        plain = model(**enc).last_hidden_state
        with attnkit.intervene(model, iv):
            got = model(**enc).last_hidden_state
    expect = eager_reference(reference, enc, region, sentences, renormalize).last_hidden_state
    assert max_diff(got, expect, mask) <= 1e-5
    return got, plain, mask


# --- plain forwards against the eager reference --------------------------------------------------------
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("region", ["no_inter", "no_intra"])
@pytest.mark.parametrize("segments", ["token_type_ids", "separators"])
def test_bert_pairs_match_eager(bert_tokenizer, region, renormalize, segments):
    tok = bert_tokenizer
    model, reference = twins(tiny_bert(tok), tokenizer=tok if segments == "separators" else None)
    enc = tok(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt",
              return_token_type_ids=segments == "token_type_ids")
    sentences = segment_sentences(enc)
    assert sentences.any() and (enc["attention_mask"] == 0).any()  # pairs, and padding
    got, plain, mask = region_matches_eager(model, reference, enc, region, renormalize, sentences)
    assert max_diff(got, plain, mask) > 1e-3  # the intervention did something (100× the tolerance)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("region", ["no_inter", "no_intra"])
def test_roberta_pairs_match_eager(roberta_tokenizer, region, renormalize):
    """`</s></s>` separates the segments; the single text in the batch is one sentence."""
    tok = roberta_tokenizer
    model, reference = twins(tiny_roberta(tok))  # separators from the config's eos_token_id
    enc = tok([(QUESTIONS[0], CONTEXTS[0]), SINGLE[1]], padding=True, return_tensors="pt")
    assert "token_type_ids" not in enc
    sentences = segment_sentences(enc)
    assert sentences[0].any() and not sentences[1].any()
    got, plain, mask = region_matches_eager(model, reference, enc, region, renormalize, sentences)
    assert max_diff(got[:1], plain[:1], mask[:1]) > 1e-3


def test_bert_inputs_embeds_with_token_type_ids(bert_tokenizer):
    """Segments A and B from token_type_ids alone, without input_ids."""
    model, reference = twins(tiny_bert(bert_tokenizer))
    enc = bert_tokenizer(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt")
    inputs = {"inputs_embeds": model.get_input_embeddings()(enc["input_ids"]).detach(),
              "attention_mask": enc["attention_mask"], "token_type_ids": enc["token_type_ids"]}
    with torch.no_grad(), attnkit.intervene(model, plan_intervention(model, "no_intra", True)):
        got = model(**inputs).last_hidden_state
    expect = eager_reference(reference, inputs, "no_intra", enc["token_type_ids"], True).last_hidden_state
    assert max_diff(got, expect, enc["attention_mask"]) <= 1e-5


def test_sentence_ids_from_inputs_rules():
    from attnkit.hf_attention import sentence_ids_from_inputs

    SEP, CLS = 9, 8
    ids = torch.tensor([[CLS, 1, 2, SEP, SEP, 3, SEP, 0],    # RoBERTa pair (</s></s>), one padding token
                        [CLS, 1, SEP, 2, 3, 4, SEP, SEP],    # BERT pair without token types
                        [CLS, 1, 2, 3, 4, 5, 6, SEP]])       # single text
    lengths = [7, 8, 8]
    got = sentence_ids_from_inputs(ids, None, lengths, 8, [SEP])
    assert got.tolist() == [[0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1], [0] * 8]
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0] * 8, [0] * 8])  # varying types win over separators
    got = sentence_ids_from_inputs(ids, types, lengths, 8, [SEP])
    assert got.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1], [0] * 8]
    got = sentence_ids_from_inputs(None, types, lengths, 8, [SEP])  # no ids: one type is a single text
    assert got.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0], [0] * 8, [0] * 8]
    with pytest.raises(AttnkitError, match="sample 0 .*names no separator token"):
        sentence_ids_from_inputs(ids, None, lengths, 8, [])


def test_eager_reference_without_region_equals_attnkit(bert_tokenizer):
    """The reference attention itself is plain attention when no region is applied."""
    model, reference = twins(tiny_bert(bert_tokenizer))
    enc = bert_tokenizer(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        got = model(**enc).last_hidden_state
    expect = eager_reference(reference, enc, None, None, False).last_hidden_state
    assert max_diff(got, expect, enc["attention_mask"]) <= 1e-5


def test_task_model_with_positional_inputs(bert_tokenizer):
    """A task head passes input_ids to the encoder positionally; the hook still sees them."""
    model, reference = twins(tiny_bert(bert_tokenizer, BertForSequenceClassification, num_labels=3))
    enc = bert_tokenizer(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt")
    iv = plan_intervention(model, "no_inter", False)
    with torch.no_grad(), attnkit.intervene(model, iv):
        got = model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).logits
    expect = eager_reference(reference, enc, "no_inter", segment_sentences(enc), False).logits
    assert (got - expect).abs().max().item() <= 1e-5


def test_minilm_no_inter_on_a_pair_is_not_a_no_op(minilm):
    """The issue's case: the embedded MiniLM, layer 3 no_inter, two question/context pairs."""
    model, tok = minilm
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(EAGER)
    enc = tok(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt")
    iv = attnkit.Intervention.for_model(model).set(3, None, region="no_inter")
    with torch.no_grad():
        plain = model(**enc).last_hidden_state
        with attnkit.intervene(model, iv):
            got = model(**enc).last_hidden_state
    regions = {l: ["no_inter" if l == 3 else "all"] * 12 for l in range(6)}
    _reference.update(regions=regions, sentences=segment_sentences(enc))
    try:
        with torch.no_grad():
            expect = reference(**enc).last_hidden_state
    finally:
        _reference.update(regions=None, sentences=None)
    mask = enc["attention_mask"]
    assert max_diff(got, expect, mask) <= 1e-5
    assert max_diff(got, plain, mask) > 0.1


def test_single_text_is_one_sentence(bert_tokenizer):
    """No inter-sentence weight in a single text: no_inter leaves it as it is; no_intra removes all."""
    model = attnkit.instrument(tiny_bert(bert_tokenizer))
    enc = bert_tokenizer(SINGLE, padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    with torch.no_grad():
        plain = model(**enc).last_hidden_state
        with attnkit.intervene(model, plan_intervention(model, "no_inter", True)):
            kept = model(**enc).last_hidden_state
        with attnkit.intervene(model, plan_intervention(model, "no_intra", False)):
            removed = model(**enc).last_hidden_state
    assert max_diff(kept, plain, mask) <= 1e-6
    assert max_diff(removed, plain, mask) > 1e-2


def test_keep_everywhere_is_bit_identical(bert_tokenizer):
    model = attnkit.instrument(tiny_bert(bert_tokenizer))
    enc = bert_tokenizer(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        plain = model(**enc).last_hidden_state
        for renormalize in (False, True):
            iv = attnkit.Intervention.for_model(model)
            iv.renormalize = renormalize
            with attnkit.intervene(model, iv):
                assert torch.equal(model(**enc).last_hidden_state, plain)
        # nothing to find sentences in, but no region is active: runs, unchanged
        embeds = model.get_input_embeddings()(enc["input_ids"])
        plain_embeds = model(inputs_embeds=embeds, attention_mask=enc["attention_mask"]).last_hidden_state
        with attnkit.intervene(model, attnkit.Intervention.for_model(model).set(0, 1, mode="keep")):
            again = model(inputs_embeds=embeds, attention_mask=enc["attention_mask"]).last_hidden_state
    assert torch.equal(again, plain_embeds)


# --- user-given sentences and attnkit's own batches ----------------------------------------------------
def test_user_sentences_split_a_text(bert_tokenizer):
    """attnkit.sentences and intervene(sentences=) use the given ids, over the token_type_ids."""
    tok = bert_tokenizer
    model, reference = twins(tiny_bert(tok))
    enc = tok(SINGLE, padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    sentences = (torch.arange(mask.shape[1])[None, :] >= torch.tensor([[5], [2]])).int()  # split each text
    iv = plan_intervention(model, "no_inter", True)
    expect = eager_reference(reference, enc, "no_inter", sentences, True).last_hidden_state
    with torch.no_grad():
        with attnkit.sentences(model, sentences.tolist()), attnkit.intervene(model, iv):
            a = model(**enc).last_hidden_state
        with attnkit.intervene(model, iv, sentences=sentences.numpy()):
            b = model(**enc).last_hidden_state
        plain = model(**enc).last_hidden_state
    assert max_diff(a, expect, mask) <= 1e-5
    assert torch.equal(a, b)
    assert max_diff(a, plain, mask) > 1e-2
    assert runtime_of(model).sentences is None  # restored


def test_user_sentences_are_checked(bert_tokenizer):
    model = attnkit.instrument(tiny_bert(bert_tokenizer))
    enc = bert_tokenizer(SINGLE, padding=True, return_tensors="pt")
    B, L = enc["input_ids"].shape
    iv = plan_intervention(model, "no_inter", False)
    with pytest.raises(AttnkitError, match=rf"shape \({B}, {L + 1}\).*{B} × {L} tokens") as err:
        with torch.no_grad(), attnkit.intervene(model, iv, sentences=torch.zeros(B, L + 1, dtype=torch.int64)):
            model(**enc)
    assert "\n" not in str(err.value)
    rt = runtime_of(model)
    assert rt.open_forwards == 0 and rt.sentences is None and rt.intervention is None  # all cleared
    with pytest.raises(AttnkitError, match="batch × length"):
        attnkit.sentences(model, [0, 1, 1]).__enter__()
    with pytest.raises(AttnkitError, match="integers"):
        attnkit.sentences(model, torch.zeros(B, L)).__enter__()


def test_attnkit_batches_take_precedence(bert_tokenizer):
    """Inside Runtime.batch_of (extract, ablate) the batch's sentence ids are used, not the segments."""
    tok = bert_tokenizer
    model, reference = twins(tiny_bert(tok))
    batch = Encoder(tok, max_length=64, split_sentences=True)(list(zip(QUESTIONS, CONTEXTS)))
    assert int(batch.sentence_id[1].max()) == 2  # "Rivers bend." | "Lakes form ..." split
    iv = plan_intervention(model, "no_intra", False)
    with torch.no_grad(), attnkit.intervene(model, iv), runtime_of(model).batch_of(batch):
        got = model(**batch.inputs).last_hidden_state
    expect = eager_reference(reference, batch.inputs, "no_intra", batch.sentence_id, False).last_hidden_state
    assert max_diff(got, expect, batch.inputs["attention_mask"]) <= 1e-5
    by_segments = eager_reference(reference, batch.inputs, "no_intra", batch.inputs["token_type_ids"], False)
    assert max_diff(got, by_segments.last_hidden_state, batch.inputs["attention_mask"]) > 1e-3


# --- refusals ------------------------------------------------------------------------------------------
def test_no_structure_is_refused(bert_tokenizer, roberta_tokenizer):
    iv_for = lambda m: plan_intervention(m, "no_inter", False)  # noqa: E731
    # BERT without token_type_ids and without a known [SEP] (no tokenizer given, none in the config)
    bert = attnkit.instrument(tiny_bert(bert_tokenizer))
    enc = bert_tokenizer(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt", return_token_type_ids=False)
    with pytest.raises(AttnkitError, match="names no separator token.*attnkit.sentences") as err:
        with torch.no_grad(), attnkit.intervene(bert, iv_for(bert)):
            bert(**enc)
    assert "\n" not in str(err.value)
    # RoBERTa from inputs_embeds: no input_ids to find </s></s> in, and token types mark nothing
    roberta = attnkit.instrument(tiny_roberta(roberta_tokenizer))
    enc = roberta_tokenizer(QUESTIONS, CONTEXTS, padding=True, return_tensors="pt")
    embeds = roberta.get_input_embeddings()(enc["input_ids"])
    with pytest.raises(AttnkitError, match=r"sample 0 .*no input_ids \(inputs_embeds\).*attnkit.sentences"):
        with torch.no_grad(), attnkit.intervene(roberta, iv_for(roberta)):
            roberta(inputs_embeds=embeds, attention_mask=enc["attention_mask"])
    # attention run outside a forward of the instrumented model
    layer = roberta.encoder.layer[0]
    with pytest.raises(AttnkitError, match="did not see this forward"):
        with torch.no_grad(), attnkit.intervene(roberta, iv_for(roberta)):
            layer(embeds)
    # and the same inputs_embeds with the ids given by the user run
    with torch.no_grad(), attnkit.intervene(roberta, iv_for(roberta), sentences=segment_sentences(enc)):
        roberta(inputs_embeds=embeds, attention_mask=enc["attention_mask"])
    assert runtime_of(roberta).open_forwards == 0


# --- repr ----------------------------------------------------------------------------------------------
def test_intervention_repr():
    iv = attnkit.Intervention.identity(6, 12).set(2, 5, mode="zero").set(3, None, mode="uniform")
    iv.set_heads([(1, h) for h in range(4)] + [(4, 7)], region="no_inter")
    assert repr(iv) == ("Intervention(6×12: zero L2H5; uniform L3; region no_inter L1H0-H3,L4H7, "
                        "renormalize=False)")
    assert repr(attnkit.Intervention.identity(2, 3)) == "Intervention(2×3: keep all, renormalize=False)"
    gated = attnkit.Intervention.from_heads((2, 3), "L0H0,L0H2", mode="zero", renormalize=True).with_gates()
    assert repr(gated) == "Intervention(2×3: zero L0H0,L0H2; gates, renormalize=True)"
