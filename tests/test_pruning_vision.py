"""Pruning vision transformers (attnkit/arch/pruning.py, docs/pruning.md): ViT, DeiT, CLIP's and SigLIP's vision
towers and DINOv2 (with and without registers), tiny and random. The pruned model's last hidden states equal the
full model's with the same heads zeroed (an attnkit Intervention), under eager, sdpa and attnkit attention; it
saves and reloads (transformers saves ViT's and DINOv2's weights under their earlier names); `attnkit prune` on a
model directory with its image processor, whose features over images are NaN for the heads it lost and those of
the zeroed full model for the others."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import attnkit
from attnkit.arch import load_pruned_model, prune_heads, pruned_head_grid
from attnkit.cli.main import main

from .test_vision import MODELS, pixels, tiny

pytest.importorskip("PIL")

HEADS = [(0, 1), (1, 0), (1, 1)]  # 2 layers × 2 heads: layer 1 keeps none


@pytest.mark.parametrize("name", [n for n in MODELS if n != "beit"])
def test_pruned_vision_model_equals_the_zeroed_full_model(name, tmp_path):
    model, eager = tiny(name)
    x = pixels(2, 8, 8)
    with torch.no_grad(), attnkit.intervene(model, attnkit.Intervention.from_heads(model, HEADS, mode="zero")):
        want = model(pixel_values=x).last_hidden_state
    with torch.no_grad():
        assert not torch.allclose(eager(pixel_values=x).last_hidden_state, want, atol=1e-3)
    for impl in ("eager", "sdpa", "attnkit"):
        pruned = prune_heads(copy.deepcopy(eager), HEADS)
        if impl == "attnkit":
            attnkit.instrument(pruned)
        else:
            pruned.set_attn_implementation(impl)
        with torch.no_grad():
            torch.testing.assert_close(pruned(pixel_values=x).last_hidden_state, want, rtol=1e-5, atol=1e-5)
    prune_heads(copy.deepcopy(eager), HEADS).save_pretrained(tmp_path)
    loaded = load_pruned_model(tmp_path)
    assert type(loaded) is type(eager)
    assert sorted(map(tuple, np.argwhere(~pruned_head_grid(loaded)).tolist())) == HEADS
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixel_values=x).last_hidden_state, want, rtol=1e-5, atol=1e-5)


def test_the_command_prunes_a_vision_model_and_its_features_leave_the_removed_heads_out(tmp_path):
    from .test_images import save_model, write_images

    model_dir = save_model(tmp_path / "vit", "vit")
    out = tmp_path / "pruned"
    res = CliRunner().invoke(main, ["prune", str(model_dir), "--heads", "L0H1", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    assert "heads per layer now: 1 2 (3 in all)" in res.output
    images = write_images(tmp_path / "images")[:3]
    got = attnkit.extract(images=images, model=str(out), per_sample=True)
    model, processor = attnkit.load_model(str(model_dir), device="cpu")
    with attnkit.intervene(model, attnkit.Intervention.from_heads(model, [(0, 1)], mode="zero")):
        want = attnkit.extract(images=images, model=(model, processor), per_sample=True)
    a, b = np.asarray(got.per_sample), np.asarray(want.per_sample)
    assert np.isnan(a[:, 0, 1]).all()
    keep = np.ones(a.shape[1:3], dtype=bool)
    keep[0, 1] = False
    assert np.isfinite(a[:, keep]).all()
    np.testing.assert_allclose(a[:, keep], b[:, keep], rtol=1e-5, atol=1e-6)
