"""Regions of an image as sets of patches (issue 49 item 4.3; docs/interventions.md, "Regions of an image"):
`attnkit.interventions.patch_regions` gives a vision transformer's tokens region ids (quadrants, or a label map read
at each patch's centre; [CLS] and the registers a region of their own, −1), and no_intra / no_inter on a head then
remove its attention within / across regions. The hidden states equal those of the plain transformers model whose
attention is eager's with exactly those entries of the head's weights set to 0 (an attention function registered
here), and the ids themselves equal the ones computed here from the grid."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers as T

import attnkit
from attnkit.errors import AttnkitError
from attnkit.interventions import patch_regions

SIZE, PATCH = 32, 8  # 4 × 4 patches
SMALL = dict(image_size=SIZE, patch_size=PATCH, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=32, initializer_range=0.5)
REMOVED = {}  # what the reference attention removes: {"regions": B×L ids, "heads": {(layer, head): region}}


def eager_without(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention whose weights lose, for the heads in REMOVED, the keys in the query's region (no_intra) or
    in any other region (no_inter); no renormalisation."""
    w = torch.softmax(query @ key.transpose(-1, -2) * scaling, dim=-1)
    ids = REMOVED["regions"]
    same = ids[:, None, :, None] == ids[:, None, None, :]  # B × 1 × L × L
    for (layer, head), region in REMOVED["heads"].items():
        if layer == module.layer_idx_for_test:
            drop = same if region == "no_intra" else ~same
            w[:, head] = w[:, head].masked_fill(drop[:, 0], 0.0)
    return (w @ value).transpose(1, 2).contiguous(), w


def models(kind: str):
    torch.manual_seed(0)
    if kind == "vit":
        cfg, cls = T.ViTConfig(**SMALL), T.ViTModel
    else:
        cfg = T.Dinov2WithRegistersConfig(**{k: v for k, v in SMALL.items() if k != "intermediate_size"},
                                          mlp_ratio=2, num_register_tokens=2)
        cls = T.Dinov2WithRegistersModel
    ours = cls(cfg).eval()
    ref = cls(copy.deepcopy(cfg)).eval()  # its own config: instrument sets the attention of `ours`'s
    ref.load_state_dict(ours.state_dict())
    T.AttentionInterface.register("eager_without_regions", eager_without)
    ref.set_attn_implementation("eager_without_regions")
    for i, layer in enumerate(ref.encoder.layer if hasattr(ref, "encoder") else ref.layers):
        attn = layer.attention
        (attn.attention if hasattr(attn, "attention") else attn).layer_idx_for_test = i
    return attnkit.instrument(ours), ref


def quadrants(prefix: int, B: int) -> torch.Tensor:
    ids = [-1] * prefix + [(r // 2) * 2 + (c // 2) for r in range(4) for c in range(4)]
    return torch.tensor([ids] * B, dtype=torch.int32)


@pytest.mark.parametrize("kind, prefix", [("vit", 1), ("dinov2", 3)])
@pytest.mark.parametrize("regions", ["quadrants", "map"])
def test_no_inter_and_no_intra_remove_exactly_the_attention_across_and_within_regions(kind, prefix, regions):
    ours, ref = models(kind)
    B = 2
    px = torch.rand(B, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    if regions == "quadrants":
        given, want = "quadrants", quadrants(prefix, B)
    else:  # a label map in pixels: per image, ids in horizontal bands of 8 pixels and a left/right split
        given = torch.stack([torch.arange(SIZE)[:, None] // 8 * torch.ones(SIZE, dtype=torch.long),
                             (torch.arange(SIZE)[None, :] >= 16) * torch.ones(SIZE, 1, dtype=torch.long)])
        want = torch.tensor([[-1] * prefix + [r for r in range(4) for _ in range(4)],
                             [-1] * prefix + [int(c >= 2) for _ in range(4) for c in range(4)]], dtype=torch.int32)
    ids = patch_regions(ours, given, batch=B)
    assert torch.equal(ids, want)
    heads = {(0, 1): "no_inter", (1, 0): "no_intra"}
    iv = attnkit.Intervention.for_model(ours)
    for (layer, head), region in heads.items():
        iv.set(layer, head, mode="keep", region=region)
    with torch.no_grad():
        plain = ours(pixel_values=px).last_hidden_state
        with attnkit.intervene(ours, iv, sentences=ids):
            got = ours(pixel_values=px).last_hidden_state
        REMOVED.update(regions=want, heads=heads)
        expected = ref(pixel_values=px).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-2  # the regions changed what the heads see


def test_bad_regions_are_refused_by_name():
    ours, _ = models("vit")
    with pytest.raises(AttnkitError, match="unknown image regions 'halves'"):
        patch_regions(ours, "halves")
    with pytest.raises(AttnkitError, match="integer region ids, got torch.float32"):
        patch_regions(ours, np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(AttnkitError, match="non-negative"):
        patch_regions(ours, -np.ones((4, 4), dtype=np.int64))
    with pytest.raises(AttnkitError, match=r"batch × H × W with batch 2, got shape \(3, 4, 4\)"):
        patch_regions(ours, np.zeros((3, 4, 4), dtype=np.int64), batch=2)
    text = attnkit.instrument(T.BertModel(T.BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                       num_attention_heads=2, intermediate_size=32)).eval())
    with pytest.raises(AttnkitError, match="takes text"):
        patch_regions(text, "quadrants")
    # one id per patch (a 4 × 4 map) is read as it is; a map of another size at each patch's centre
    per_patch = np.arange(16).reshape(4, 4)
    assert patch_regions(ours, per_patch)[0, 1:].tolist() == list(range(16))
    assert patch_regions(ours, np.kron(per_patch, np.ones((3, 5), dtype=np.int64)))[0, 1:].tolist() == list(range(16))
