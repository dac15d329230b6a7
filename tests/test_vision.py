"""Vision transformers through attnkit's op (issue 49, items 1 and 2): tiny random ViT, DeiT, CLIP and SigLIP vision
towers, DINOv2 with and without registers and BEiT give eager's maps and hidden states, and `attnkit.track`'s
entropy, mean attention distance and masses on [CLS] and registers equal the same quantities computed here from
eager's maps; the op's `mean_attention_distance` (the reference and the CPU kernel) against an independent PyTorch
computation over shapes, padding and edge cases (docs/features.md, "Image heads")."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers as T

import attnkit
from attnkit import ops
from attnkit.errors import AttnkitError
from attnkit.features import CLS, OTHER, SEP
from attnkit.reference import reference_attention

SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, hidden_act="gelu")
# model type → (config, model, config keywords, tokens before the patches)
MODELS = {
    "vit": (T.ViTConfig, T.ViTModel, dict(intermediate_size=32), 1),
    "deit": (T.DeiTConfig, T.DeiTModel, dict(intermediate_size=32), 2),
    "clip": (T.CLIPVisionConfig, T.CLIPVisionModel, dict(intermediate_size=32), 1),
    "siglip": (T.SiglipVisionConfig, T.SiglipVisionModel, dict(intermediate_size=32), 0),
    "dinov2": (T.Dinov2Config, T.Dinov2Model, dict(mlp_ratio=2), 1),
    "dinov2_registers": (T.Dinov2WithRegistersConfig, T.Dinov2WithRegistersModel,
                         dict(mlp_ratio=2, num_register_tokens=3), 4),
    "beit": (T.BeitConfig, T.BeitModel, dict(intermediate_size=32), 1),
}
PATCH = 2


def tiny(name: str, image_size: int = 8):
    """(instrumented model, its eager copy) of `name`, random weights, in eval mode."""
    cfg_cls, model_cls, extra, _ = MODELS[name]
    torch.manual_seed(0)
    cfg = cfg_cls(image_size=image_size, patch_size=PATCH, **SMALL, **extra)
    eager = model_cls._from_config(cfg, attn_implementation="eager").eval()
    model = attnkit.instrument(copy.deepcopy(eager))
    return model, eager


def pixels(B: int, height: int, width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, 3, height, width, generator=torch.Generator().manual_seed(seed))


def grid_of(prefix: int, rows: int, cols: int) -> torch.Tensor:
    """L×2 float (row, col) of each token, NaN for the tokens before the patches (written here from the models'
    embeddings: the prefix tokens, then the patches in row-major order)."""
    pos = torch.full((prefix + rows * cols, 2), float("nan"))
    for i in range(rows * cols):
        pos[prefix + i] = torch.tensor([i // cols, i % cols], dtype=torch.float32)
    return pos


def expected_from_maps(maps, prefix: int, rows: int, cols: int) -> dict:
    """Per layer and head, from eager's B×H×L×L maps: the mean row entropy, the mean attention distance
    (Σ_j a_ij·‖grid(i) − grid(j)‖ over patch queries i and patch keys j, averaged over patch queries and images),
    the mass on [CLS] and on the other tokens before the patches."""
    pos = grid_of(prefix, rows, cols)
    patch = ~pos[:, 0].isnan()
    d = torch.cdist(pos[patch].double(), pos[patch].double())  # patch × patch distances
    out = {"entropy": [], "mean_attention_distance": [], "cls": [], "sep": []}
    for a in maps:
        a = a.double()
        out["entropy"].append((-torch.special.xlogy(a, a).sum(-1)).mean((0, 2)))
        out["mean_attention_distance"].append((a[:, :, patch][..., patch] * d).sum(-1).mean((0, 2)))
        out["cls"].append(a[..., 0].mean((0, 2)) if prefix else torch.zeros(a.shape[1], dtype=a.dtype))
        out["sep"].append(a[..., 1:prefix].sum(-1).mean((0, 2)))
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_maps_hidden_states_and_tracked_features_equal_eagers(name):
    model, eager = tiny(name)
    px = pixels(3, 8, 8)
    with torch.no_grad():
        ref = eager(pixel_values=px, output_attentions=True, output_hidden_states=True)
        got = model(pixel_values=px, output_attentions=True, output_hidden_states=True)
    for a, b in zip(got.hidden_states, ref.hidden_states):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(got.attentions) == len(ref.attentions) == 2
    for a, b in zip(got.attentions, ref.attentions):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    prefix = MODELS[name][3]
    features = ("entropy", "mean_attention_distance", "cls", "sep")
    with attnkit.track(model, features=features) as tracker, torch.no_grad():
        model(pixel_values=px)
    stats = tracker.read()
    want = expected_from_maps(ref.attentions, prefix, 4, 4)
    for f in features:
        torch.testing.assert_close(stats[f].double(), want[f], atol=1e-5, rtol=1e-5, msg=f"{name}: {f}")
    assert float(want["mean_attention_distance"].min()) > 0.1  # a real distance, not zeros compared with zeros


@pytest.mark.parametrize("name, height, width", [("dinov2_registers", 8, 12), ("vit", 12, 6), ("clip", 10, 8)])
def test_a_grid_that_is_not_square_from_interpolated_position_embeddings(name, height, width):
    """An image of another size than the config's: the grid follows the forward's pixel_values (rows × columns =
    height / patch × width / patch), through the models' interpolated position embeddings."""
    model, eager = tiny(name)
    kw = {} if name.startswith("dinov2") else {"interpolate_pos_encoding": True}
    px = pixels(2, height, width, seed=3)
    with torch.no_grad():
        ref = eager(pixel_values=px, output_attentions=True, **kw)
        with attnkit.track(model, features=("entropy", "mean_attention_distance")) as tracker:
            out = model(pixel_values=px, **kw)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=1e-5)
    stats = tracker.read()
    want = expected_from_maps(ref.attentions, MODELS[name][3], height // PATCH, width // PATCH)
    for f in ("entropy", "mean_attention_distance"):
        torch.testing.assert_close(stats[f].double(), want[f], atol=1e-5, rtol=1e-5, msg=f)


def test_the_image_tokens_classes_and_feature_names():
    model, _ = tiny("dinov2_registers")
    rt = attnkit.models.runtime_of(model)
    assert rt.image.prefix == (CLS, SEP, SEP, SEP)
    names = attnkit.models.model_feature_names(model, 16)
    assert names[-1] == "mean_attention_distance" and "sink" not in names
    text_names = attnkit.features.feature_names(16)
    assert names[:-1] == text_names


def test_vision_models_attnkit_does_not_take_are_refused_by_name():
    cfg = T.BeitConfig(image_size=8, patch_size=2, use_relative_position_bias=True, **SMALL, intermediate_size=32)
    with pytest.raises(AttnkitError, match="relative position bias"):
        attnkit.instrument(T.BeitModel(cfg).eval())
    clip = T.CLIPModel(T.CLIPConfig(text_config=dict(**SMALL, intermediate_size=32, vocab_size=50),
                                    vision_config=dict(image_size=8, patch_size=2, **SMALL, intermediate_size=32)))
    with pytest.raises(AttnkitError, match="vision tower and a text tower"):
        attnkit.instrument(clip.eval())
    swin = T.SwinModel(T.SwinConfig(image_size=8, patch_size=2, embed_dim=8, depths=[1], num_heads=[1], window_size=2))
    with pytest.raises(AttnkitError, match="'swin' takes images, but attnkit does not know its tokens"):
        attnkit.instrument(swin.eval())


def test_a_forward_whose_tokens_are_not_the_images_is_refused_when_features_are_wanted():
    from attnkit.attention.positions import ImageTokens, image_layout

    layout = image_layout(T.ViTConfig(image_size=8, patch_size=2, **SMALL))
    with pytest.raises(AttnkitError, match=r"1 tokens before its 4×4 patches \(17 in all\), but its attention got 20"):
        ImageTokens(layout, (8, 8)).grid(1, 20, "cpu")


# --- the op's feature against an independent computation ----------------------------------------------------


def independent(q, k, lengths, grid):
    """B×H mean attention distance from softmax weights computed here: for each valid patch row, Σ over patch keys
    of weight × Euclidean distance on the grid, averaged over the sample's valid patch rows (0 with none)."""
    B, H, L, D = q.shape
    out = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        w = torch.softmax(q[b, :, :n].double() @ k[b, :, :n].double().transpose(-1, -2) / math.sqrt(D), -1)
        g = grid[b, :n].double()
        patch = g[:, 0] >= 0
        if not patch.any():
            continue
        d = torch.cdist(g[patch], g[patch])
        out[b] = (w[:, patch][..., patch] * d).sum(-1).mean(-1)
    return out


def image_grid(B, L, first: int, rows: int, cols: int, lengths=None) -> torch.Tensor:
    """B×L×2 int32: `first` tokens that are no patch, then the rows × cols patches, then tokens that are no patch to
    the end (and padding)."""
    grid = torch.full((B, L, 2), -1, dtype=torch.int32)
    i = torch.arange(rows * cols, dtype=torch.int32)
    grid[:, first:first + rows * cols, 0] = i // cols
    grid[:, first:first + rows * cols, 1] = i % cols
    return grid


CASES = [  # (B, H, L, D, lengths, first, rows, cols)
    (2, 3, 17, 8, None, 1, 4, 4),  # [CLS] then a square grid
    (2, 2, 21, 8, None, 5, 4, 4),  # [CLS] and four registers
    (3, 2, 15, 4, None, 0, 3, 5),  # patches only, a grid that is not square
    (2, 2, 9, 8, None, 2, 1, 6),  # one row of patches, non-patch tokens first and last
    (2, 2, 3, 8, None, 1, 1, 1),  # one patch
    (3, 2, 14, 8, [14, 9, 5], 1, 3, 4),  # padding: the last samples cut inside the grid
    (2, 2, 70, 16, [70, 41], 2, 6, 11),  # more keys than one of the kernel's blocks in tests below
]


def backends():
    return ["reference"] + (["fused"] if ops.fused_grid("cpu") else [])


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("case", CASES)
def test_the_ops_mean_attention_distance_against_pytorch(case, backend, monkeypatch):
    if backend not in backends():
        pytest.skip("this build of the CPU kernel does not take the grid: rebuild the extension")
    B, H, L, D, lengths, first, rows, cols = case
    monkeypatch.setenv("ATTNKIT_CPU_BLOCKS", "8x16")  # several query and key blocks (the online rescaling)
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, generator=g) * 2 for _ in range(3))
    lengths = torch.tensor(lengths or [L] * B)
    grid = image_grid(B, L, first, rows, cols)
    classes = torch.where(grid[..., 0] >= 0, OTHER, SEP).int()
    classes[:, 0] = CLS
    _, feats = ops.attention(q, k, v, lengths, classes, want_features=True, grid=grid, backend=backend)
    want = independent(q, k, lengths, grid)
    torch.testing.assert_close(feats[..., -1].double(), want, atol=1e-5, rtol=1e-5)
    _, plain = ops.attention(q, k, v, lengths, classes, want_features=True, backend=backend)
    assert feats.shape[-1] == plain.shape[-1] + 1
    torch.testing.assert_close(feats[..., :-1], plain, atol=1e-6, rtol=1e-6)  # the other features unchanged


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_the_distance_under_interventions_norm_weighting_and_a_sink(backend):
    """Mode uniform spreads each row over its keys; mode zero gives 0; a key scale weighs the keys (norm
    weighting); a sink takes mass that is at no distance; the fused kernel equals the reference throughout."""
    if backend not in backends():
        pytest.skip("this build of the CPU kernel does not take the grid: rebuild the extension")
    B, H, L, D = 2, 3, 13, 8
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    lengths = torch.tensor([13, 10])
    grid = image_grid(B, L, 1, 3, 4)
    kw = dict(want_features=True, grid=grid, mode=torch.tensor([0, 1, 2], dtype=torch.int32),
              key_scale=torch.rand(B, H, L, generator=g) + 0.1, sink=torch.tensor([0.5, -1.0, 2.0]))
    _, feats = ops.attention(q, k, v, lengths, **kw, backend=backend)
    _, ref = reference_attention(q, k, v, lengths, **kw)
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)
    assert float(feats[:, 1, -1].abs().max()) == 0.0  # mode zero
    # mode uniform, no key scale: each patch row's mean distance to the n patches it sees, / n keys
    _, uni = ops.attention(q, k, v, lengths, want_features=True, grid=grid, mode=kw["mode"], backend=backend)
    for b, n in enumerate(lengths.tolist()):
        pos = grid[b, :n].double()
        patch = pos[:, 0] >= 0
        want = torch.cdist(pos[patch], pos[patch]).sum(-1).mean() / n
        assert abs(float(uni[b, 2, -1]) - float(want)) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_a_bad_grid_is_refused_by_name(backend):
    if backend not in backends():
        pytest.skip("this build of the CPU kernel does not take the grid: rebuild the extension")
    q = torch.randn(1, 1, 5, 4)
    grid = image_grid(1, 5, 1, 2, 2)
    grid[0, 2, 1] = -1  # a patch with a row and no column
    with pytest.raises(AttnkitError, match="grid positions must be"):
        ops.attention(q, q, q, torch.tensor([5]), want_features=True, grid=grid, backend=backend)
    with pytest.raises(AttnkitError, match="grid must have shape"):
        ops.attention(q, q, q, torch.tensor([5]), want_features=True, grid=grid[:, :4], backend=backend)
    # without features the grid is not read
    out, feats = ops.attention(q, q, q, torch.tensor([5]), grid=grid, backend=backend)
    assert feats.shape == (1, 1, 0)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_a_grid_with_cross_attention_is_refused_by_name(backend):
    """A grid places one sequence's tokens on one image: with cross-attention (key_lengths, two sequences) every
    backend refuses it by name, the compiled CPU kernel too when called directly."""
    if backend not in backends():
        pytest.skip("this build of the CPU kernel does not take the grid: rebuild the extension")
    q, k = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 7, 4)
    with pytest.raises(AttnkitError, match="takes no grid"):
        ops.attention(q, k, k, torch.tensor([5]), key_lengths=torch.tensor([7]), want_features=True,
                      grid=image_grid(1, 7, 1, 2, 3), backend=backend)
    if backend == "fused" and ops.fused_cross("cpu"):
        with pytest.raises(RuntimeError, match="grid is not taken with key_lengths"):
            torch.ops.attnkit.fused_attention(q, k, k, torch.tensor([5]), None, None, 0.5, 4, None, None, False, None,
                                              True, key_lengths=torch.tensor([7]), grid=image_grid(1, 7, 1, 2, 3))


@pytest.mark.parametrize("Lq", [1, 6])
def test_fewer_queries_than_keys_with_a_grid(Lq):
    """A KV-cache step's rows are the last Lq key positions: the fused kernel's distance equals the reference's."""
    if "fused" not in backends():
        pytest.skip("this build of the CPU kernel does not take the grid: rebuild the extension")
    B, H, L, D = 2, 2, 13, 8
    g = torch.Generator().manual_seed(Lq)
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(2))
    lengths = torch.tensor([13, 11])
    grid = image_grid(B, L, 1, 3, 4)
    _, fused = ops.attention(q, k, v, lengths, want_features=True, grid=grid, backend="fused")
    _, ref = reference_attention(q, k, v, lengths, want_features=True, grid=grid)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)


def test_a_training_forward_tracks_the_distance_and_the_max_logit_through_the_lse_op():
    """With gradients wanted the CPU op runs as attnkit::fused_attention_lse (grid and want_max_logit by keyword):
    the tracked distance is still eager's, the max logit is there, and backward runs."""
    model, eager = tiny("vit")
    model.train()
    px = pixels(2, 8, 8, seed=5)
    with torch.no_grad():
        ref = eager(pixel_values=px, output_attentions=True)
    with attnkit.track(model, features=("mean_attention_distance", "max_logit")) as tracker:
        model(pixel_values=px).last_hidden_state.square().mean().backward()
    stats = tracker.read()
    want = expected_from_maps(ref.attentions, 1, 4, 4)["mean_attention_distance"]
    torch.testing.assert_close(stats["mean_attention_distance"].double(), want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(stats["max_logit"]).all()
    assert model.embeddings.patch_embeddings.projection.weight.grad is not None
