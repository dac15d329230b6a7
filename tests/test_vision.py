"""Vision transformers through attnkit's op (issue 49, items 1 and 2): tiny random ViT, DeiT, CLIP and SigLIP vision
towers, DINOv2 with and without registers and BEiT give eager's maps and hidden states, and `attnkit.track`'s
entropy, mean attention distance and masses on [CLS] and registers equal the same quantities computed here from
eager's maps; the op's `mean_attention_distance` and masses within rings of distance (the reference, on which
every call with a grid runs) against an independent PyTorch computation over shapes, padding and edge cases
(docs/features.md, "Image heads")."""
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
from attnkit.reference import image_features

# the rings of distance on the patch grid, written here (docs/features.md, "Image heads"): [lo, hi) in patches
RINGS = {"ring_0": (0, 1), "ring_1": (1, 2), "ring_2": (2, 4), "ring_4": (4, 8), "ring_8": (8, math.inf)}
IMAGE = ("mean_attention_distance", *RINGS)

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


def patch_distances(pos: torch.Tensor) -> torch.Tensor:
    """P×P float64 Euclidean distances between the P positions `pos` (sqrt of exact integer squares: a distance of
    2, 4 or 8 is exact, so it falls in the ring it starts)."""
    diff = pos.double()[:, None] - pos.double()[None]
    return diff.square().sum(-1).sqrt()


def expected_from_maps(maps, prefix: int, rows: int, cols: int) -> dict:
    """Per layer and head, from eager's B×H×L×L maps: the mean row entropy, the mean attention distance
    (Σ_j a_ij·‖grid(i) − grid(j)‖ over patch queries i and patch keys j, averaged over patch queries and images),
    the masses within the RINGS (Σ_j a_ij over the patch keys j at a distance in the ring, averaged alike), the mass
    on [CLS] and on the other tokens before the patches."""
    pos = grid_of(prefix, rows, cols)
    patch = ~pos[:, 0].isnan()
    d = patch_distances(pos[patch])  # patch × patch distances
    out = {"entropy": [], "mean_attention_distance": [], "cls": [], "sep": [], **{r: [] for r in RINGS}}
    for a in maps:
        a = a.double()
        out["entropy"].append((-torch.special.xlogy(a, a).sum(-1)).mean((0, 2)))
        pp = a[:, :, patch][..., patch]  # patch rows × patch keys
        out["mean_attention_distance"].append((pp * d).sum(-1).mean((0, 2)))
        for r, (lo, hi) in RINGS.items():
            out[r].append((pp * ((d >= lo) & (d < hi))).sum(-1).mean((0, 2)))
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
    features = ("entropy", *IMAGE, "cls", "sep")
    with attnkit.track(model, features=features) as tracker, torch.no_grad():
        model(pixel_values=px)
    stats = tracker.read()
    want = expected_from_maps(ref.attentions, prefix, 4, 4)
    for f in features:
        torch.testing.assert_close(stats[f].double(), want[f], atol=1e-5, rtol=1e-5, msg=f"{name}: {f}")
    assert float(want["mean_attention_distance"].min()) > 0.1  # a real distance, not zeros compared with zeros
    for r in ("ring_0", "ring_1", "ring_2"):  # real masses (a 4 × 4 grid reaches no distance of 8)
        assert float(want[r].min()) > 0.01


@pytest.mark.parametrize("name, height, width", [("dinov2_registers", 8, 12), ("vit", 12, 6), ("clip", 10, 8)])
def test_a_grid_that_is_not_square_from_interpolated_position_embeddings(name, height, width):
    """An image of another size than the config's: the grid follows the forward's pixel_values (rows × columns =
    height / patch × width / patch), through the models' interpolated position embeddings."""
    model, eager = tiny(name)
    kw = {} if name.startswith("dinov2") else {"interpolate_pos_encoding": True}
    px = pixels(2, height, width, seed=3)
    with torch.no_grad():
        ref = eager(pixel_values=px, output_attentions=True, **kw)
        with attnkit.track(model, features=("entropy", *IMAGE)) as tracker:
            out = model(pixel_values=px, **kw)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=1e-5)
    stats = tracker.read()
    want = expected_from_maps(ref.attentions, MODELS[name][3], height // PATCH, width // PATCH)
    for f in ("entropy", *IMAGE):
        torch.testing.assert_close(stats[f].double(), want[f], atol=1e-5, rtol=1e-5, msg=f)


def test_the_image_tokens_classes_and_feature_names():
    model, _ = tiny("dinov2_registers")
    rt = attnkit.models.runtime_of(model)
    assert rt.image.prefix == (CLS, SEP, SEP, SEP)
    names = attnkit.models.model_feature_names(model, 16)
    assert names[-6:] == list(IMAGE) and "sink" not in names
    text_names = attnkit.features.feature_names(16)
    assert names[:-6] == text_names


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


def independent(q, k, lengths, grid, Lq: int | None = None):
    """B×H×6 (IMAGE) from softmax weights computed here: for each valid patch row, Σ over patch keys of weight ×
    Euclidean distance on the grid, then Σ over the patch keys in each of the RINGS of weight, averaged over the
    sample's valid patch rows (0 with none). `Lq`: only the last Lq rows of the full forward (a KV-cache step)."""
    B, H, L, D = k.shape
    first = L - (Lq or L)
    out = torch.zeros(B, H, len(IMAGE), dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        qb = q[b].double() if Lq is None else torch.cat([torch.zeros(H, first, D, dtype=torch.float64),
                                                         q[b].double()], 1)
        w = torch.softmax(qb[:, :n] @ k[b, :, :n].double().transpose(-1, -2) / math.sqrt(D), -1)
        g = grid[b, :n]
        patch = g[:, 0] >= 0
        rows = patch.clone()
        rows[:first] = False  # the rows a step does not compute
        if not rows.any():
            continue
        d = patch_distances(g)[rows][:, patch]
        pp = w[:, rows][..., patch]
        out[b, :, 0] = (pp * d).sum(-1).mean(-1)
        for i, (lo, hi) in enumerate(RINGS.values(), 1):
            out[b, :, i] = (pp * ((d >= lo) & (d < hi))).sum(-1).mean(-1)
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


# the backends that measure a grid's features on CPU: the reference, and the compiled kernel of a build that measures
# the ring masses (`ops.fused_grid`)
BACKENDS = ["reference"] + (["fused"] if ops.fused_grid("cpu") else [])


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
@pytest.mark.parametrize("case", CASES)
def test_the_ops_image_features_against_pytorch(case, backend):
    B, H, L, D, lengths, first, rows, cols = case
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, generator=g) * 2 for _ in range(3))
    lengths = torch.tensor(lengths or [L] * B)
    grid = image_grid(B, L, first, rows, cols)
    classes = torch.where(grid[..., 0] >= 0, OTHER, SEP).int()
    classes[:, 0] = CLS
    _, feats = ops.attention(q, k, v, lengths, classes, want_features=True, grid=grid, backend=backend)
    want = independent(q, k, lengths, grid)
    torch.testing.assert_close(feats[..., -6:].double(), want, atol=1e-5, rtol=1e-5)
    _, plain = ops.attention(q, k, v, lengths, classes, want_features=True, backend=backend)
    assert feats.shape[-1] == plain.shape[-1] + 6
    torch.testing.assert_close(feats[..., :-6], plain, atol=1e-6, rtol=1e-6)  # the other features unchanged


def test_the_ring_masses_sum_to_the_patch_rows_mass_on_patches():
    """The rings partition the patch keys (every distance falls in exactly one, a distance of 2, 4 or 8 in the
    ring it starts), so they sum to each patch row's mass on the patch keys, averaged over the patch rows; on a
    6 × 11 grid every ring holds mass."""
    L, first = 70, 2
    grid = image_grid(1, L, first, 6, 11)
    w = torch.softmax(torch.randn(1, 2, L, L, generator=torch.Generator().manual_seed(3)), -1)
    feats = image_features(w, torch.tensor([L]), grid)
    patch_mass = w[0, :, first:first + 66, first:first + 66].sum(-1).mean(-1)
    torch.testing.assert_close(feats[0, :, 1:].sum(-1), patch_mass, atol=1e-6, rtol=1e-6)
    assert float(feats[..., 1:].min()) > 0.01


def test_the_worked_example_of_the_docs():
    """docs/features.md, "Image heads", worked example: a 2 × 2 grid after [CLS]."""
    A = torch.full((1, 1, 5, 5), 0.2)
    A[0, 0, 1] = torch.tensor([0.10, 0.40, 0.20, 0.20, 0.10])
    grid = image_grid(1, 5, 1, 2, 2)
    got = image_features(A, torch.tensor([5]), grid)[0, 0]
    torch.testing.assert_close(got, torch.tensor([0.6475, 0.25, 0.575, 0.0, 0.0, 0.0]), atol=1e-4, rtol=0)
    # a 1 × 9 strip, the query patch first, uniform weights: distances 0..8, each bound in the ring it starts
    A = torch.zeros(1, 1, 9, 9)
    A[0, 0, 0] = 1 / 9
    got = image_features(A, torch.tensor([9]), image_grid(1, 9, 0, 1, 9))[0, 0] * 9  # one row of the nine
    torch.testing.assert_close(got, torch.tensor([36 / 9, 1 / 9, 1 / 9, 2 / 9, 4 / 9, 1 / 9]), atol=1e-6, rtol=0)


def test_the_fused_backend_measures_a_grid_where_the_build_says_so():
    """The CPU kernel of a build with `attnkit::cpu_grid_rings` measures the distance and the rings (the cases above
    compare it with PyTorch); an older build refuses `backend="fused"` by name; without features the grid is dropped
    and the kernel runs. The CUDA kernels never take it."""
    q = torch.randn(1, 1, 5, 4)
    grid = image_grid(1, 5, 1, 2, 2)
    assert not ops.fused_grid("cuda")
    if ops.resolve_backend("auto", q.device) != "fused":
        pytest.skip("no compiled CPU kernel")
    if ops.fused_grid("cpu"):
        assert bool(torch.ops.attnkit.cpu_grid_rings())
        _, feats = ops.attention(q, q, q, torch.tensor([5]), want_features=True, grid=grid, backend="fused")
        assert feats.shape[-1] == ops.attention(q, q, q, torch.tensor([5]), want_features=True)[1].shape[-1] + 6
    else:
        with pytest.raises(AttnkitError, match="does not measure the features of an image's patch grid"):
            ops.attention(q, q, q, torch.tensor([5]), want_features=True, grid=grid, backend="fused")
    out, feats = ops.attention(q, q, q, torch.tensor([5]), grid=grid, backend="fused")
    assert feats.shape == (1, 1, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_features_under_interventions_norm_weighting_and_a_sink(backend):
    """Mode uniform spreads each row over its keys; mode zero gives 0; a key scale weighs the keys (norm
    weighting); a sink takes mass that is at no distance and in no ring."""
    B, H, L, D = 2, 3, 13, 8
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    lengths = torch.tensor([13, 10])
    grid = image_grid(B, L, 1, 3, 4)
    kw = dict(want_features=True, grid=grid, mode=torch.tensor([0, 1, 2], dtype=torch.int32),
              key_scale=torch.rand(B, H, L, generator=g) + 0.1, sink=torch.tensor([0.5, -1.0, 2.0]))
    _, feats = ops.attention(q, k, v, lengths, **kw, backend=backend)
    _, ref = ops.attention(q, k, v, lengths, **kw, backend="reference")
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)
    assert float(feats[:, 1, -6:].abs().max()) == 0.0  # mode zero
    # mode uniform, no key scale: each patch row's mean distance to the n patches it sees, / n keys; its rings
    _, uni = ops.attention(q, k, v, lengths, want_features=True, grid=grid, mode=kw["mode"], backend=backend)
    for b, n in enumerate(lengths.tolist()):
        pos = grid[b, :n]
        d = patch_distances(pos[pos[:, 0] >= 0])
        assert abs(float(uni[b, 2, -6]) - float(d.sum(-1).mean() / n)) < 1e-5
        for i, (lo, hi) in enumerate(RINGS.values(), 1):
            assert abs(float(uni[b, 2, -6 + i]) - float(((d >= lo) & (d < hi)).sum(-1).double().mean() / n)) < 1e-6
    # a sink's mass lies in no ring: the rings sum to the patch keys' share of the rows' mass
    _, sunk = ops.attention(q, k, v, lengths, want_features=True, grid=grid, sink=torch.tensor([9.0, 9.0, 9.0]),
                            backend=backend)
    assert float(sunk[..., -5:].sum(-1).max()) < 0.01


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_grid_is_refused_by_name(backend):
    q = torch.randn(1, 1, 5, 4)
    grid = image_grid(1, 5, 1, 2, 2)
    grid[0, 2, 1] = -1  # a patch with a row and no column
    with pytest.raises(AttnkitError, match="grid positions must be"):
        ops.attention(q, q, q, torch.tensor([5]), want_features=True, grid=grid, backend=backend)
    with pytest.raises(AttnkitError, match="grid must have shape"):
        ops.attention(q, q, q, torch.tensor([5]), want_features=True, grid=grid[:, :4], backend=backend)
    # without features the grid is not read
    out, feats = ops.attention(q, q, q, torch.tensor([5]), grid=grid)
    assert feats.shape == (1, 1, 0)


def test_a_grid_with_cross_attention_is_refused_by_name():
    """A grid places one sequence's tokens on one image: with cross-attention (key_lengths, two sequences) every
    backend refuses it by name, the compiled CPU kernel too when called directly."""
    q, k = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 7, 4)
    for backend in ("auto", "reference"):
        with pytest.raises(AttnkitError, match="takes no grid"):
            ops.attention(q, k, k, torch.tensor([5]), key_lengths=torch.tensor([7]), want_features=True,
                          grid=image_grid(1, 7, 1, 2, 3), backend=backend)
    if ops.fused_cross("cpu") and ops._op_takes("fused_attention", "grid"):
        with pytest.raises(RuntimeError, match="grid is not taken with key_lengths"):
            torch.ops.attnkit.fused_attention(q, k, k, torch.tensor([5]), None, None, 0.5, 4, None, None, False, None,
                                              True, key_lengths=torch.tensor([7]), grid=image_grid(1, 7, 1, 2, 3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Lq", [1, 6])
def test_fewer_queries_than_keys_with_a_grid(Lq, backend):
    """A KV-cache step's rows are the last Lq key positions: its image features are those of the full forward's
    last Lq rows."""
    B, H, L, D = 2, 2, 13, 8
    g = torch.Generator().manual_seed(Lq)
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(2))
    lengths = torch.tensor([13, 11])
    grid = image_grid(B, L, 1, 3, 4)
    _, feats = ops.attention(q, k, v, lengths, want_features=True, grid=grid, backend=backend)
    torch.testing.assert_close(feats[..., -6:].double(), independent(q, k, lengths, grid, Lq), atol=1e-5, rtol=1e-5)


def test_a_training_forward_tracks_the_distance_and_the_max_logit_through_the_lse_op():
    """With gradients wanted the CPU op runs as attnkit::fused_attention_lse (the grid by keyword) where the build
    measures a grid, else on the differentiable reference: the tracked distance and rings are eager's either way,
    the max logit is there, and backward runs."""
    model, eager = tiny("vit")
    model.train()
    px = pixels(2, 8, 8, seed=5)
    with torch.no_grad():
        ref = eager(pixel_values=px, output_attentions=True)
    with attnkit.track(model, features=(*IMAGE, "max_logit")) as tracker:
        model(pixel_values=px).last_hidden_state.square().mean().backward()
    stats = tracker.read()
    want = expected_from_maps(ref.attentions, 1, 4, 4)
    for f in IMAGE:
        torch.testing.assert_close(stats[f].double(), want[f], atol=1e-5, rtol=1e-5, msg=f)
    assert torch.isfinite(stats["max_logit"]).all()
    assert model.embeddings.patch_embeddings.projection.weight.grad is not None
