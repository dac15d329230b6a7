"""Norm weighting (Kobayashi et al. 2020; docs/features.md, "Norm-weighted features") on a vision transformer: a
tiny random ViT's norm-weighted features of images equal those computed here from eager attention's maps and the
value vectors its value projection gives, each through its head's slice of the output projection (hooks on the
eager model): ‖α_st·f(x_t)‖ normalised per row, then the mass on [CLS], the row entropy and the mean attention
distance over the patch grid."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

import transformers as T  # noqa: E402

import attnkit  # noqa: E402

from .test_images import PATCH, SIZE, pixels_of, save_model, write_images  # noqa: E402


def eager_norm_features(model_dir, paths) -> dict:
    px = pixels_of(model_dir, paths)
    eager = T.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    layers = eager.layers
    values = {}
    hooks = [lay.attention.v_proj.register_forward_hook(
        lambda m, i, o, l=l: values.__setitem__(l, o.detach().double())) for l, lay in enumerate(layers)]
    with torch.no_grad():
        maps = eager(pixel_values=px, output_attentions=True).attentions
    for h in hooks:
        h.remove()
    side = SIZE // PATCH
    grid = torch.tensor([[i // side, i % side] for i in range(side * side)], dtype=torch.float64)
    dist = torch.cdist(grid, grid)
    H = eager.config.num_attention_heads
    out = {"cls": [], "entropy": [], "mean_attention_distance": []}
    for l, lay in enumerate(layers):
        alpha = maps[l].double()  # B × H × n × n
        B, _, n, _ = alpha.shape
        D = values[l].shape[-1] // H
        v = values[l].view(B, n, H, D)
        W = lay.attention.o_proj.weight.detach().double()  # hidden × H·D
        fx = torch.stack([v[:, :, h] @ W[:, h * D:(h + 1) * D].T for h in range(H)], 1)  # B × H × n × hidden
        w = alpha * fx.norm(dim=-1)[:, :, None, :]  # ‖α_st f(x_t)‖ = α_st ‖f(x_t)‖
        w = w / w.sum(-1, keepdim=True)
        out["cls"].append(w[..., 0].mean(-1))
        out["entropy"].append((-torch.special.xlogy(w, w).sum(-1)).mean(-1))
        out["mean_attention_distance"].append((w[:, :, 1:, 1:] * dist).sum(-1).mean(-1))
    return {k: torch.stack(v, 1).numpy() for k, v in out.items()}  # B × layers × heads


def test_norm_weighted_image_features_equal_eager_hooks(tmp_path):
    model_dir = save_model(tmp_path / "vit", "vit")
    paths = write_images(tmp_path / "imgs")
    want = eager_norm_features(model_dir, paths)
    feats = attnkit.extract(images=paths, model=str(model_dir), weighting="norm", per_sample=True, batch_size=2,
                            device="cpu")
    assert feats.meta["weighting"] == "norm"
    for name, value in want.items():
        got = feats.per_sample[..., feats.names.index(name)]
        np.testing.assert_allclose(got, value, atol=2e-5, rtol=0, err_msg=name)
    plain = attnkit.extract(images=paths, model=str(model_dir), per_sample=True, batch_size=2, device="cpu")
    assert np.abs(plain.per_sample - feats.per_sample).max() > 1e-3  # the weighting changed the features
