"""`attnkit distances RUN` on an image run (`attnkit extract --images`; docs/analysis.md, docs/features.md §10): the
run's images are read again from its meta.json (checked to be the same bytes) and the Jensen-Shannon divergences
between every pair of heads equal those computed here with numpy from eager attention's maps of the same pixels;
options that say how to read text, and the Ray engine, are refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("PIL")
pytest.importorskip("skimage")

import transformers as T  # noqa: E402

from attnkit.cli.main import main  # noqa: E402
from attnkit.run.distances import HeadDistances  # noqa: E402

from .test_images import PATCH, SIZE, SMALL, eager_image_maps, write_images  # noqa: E402


def sharp_vit(path):
    """A tiny random ViT whose heads differ (queries scaled up), saved with its image processor."""
    torch.manual_seed(0)
    model = T.ViTModel(T.ViTConfig(image_size=SIZE, patch_size=PATCH, intermediate_size=32, **SMALL)).eval()
    queries = [p for name, p in model.named_parameters() if name.endswith(("q_proj.weight", "query.weight"))]
    assert len(queries) == SMALL["num_hidden_layers"]
    with torch.no_grad():
        for weight in queries:
            weight.mul_(40.0)
    model.save_pretrained(path)
    T.ViTImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(path)
    return path


def js_by_numpy(model_dir, paths) -> np.ndarray:
    """Σ over images and query rows of JS(A_i[s], A_j[s]) (natural logs) between heads m = layer · H + head."""
    maps = eager_image_maps(model_dir, paths)
    a = np.concatenate([m.double().numpy() for m in maps], axis=1)  # B × M × L × L
    M = a.shape[1]

    def plogp(x):
        return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)

    out = np.zeros((M, M))
    for i in range(M):
        for j in range(M):
            p, q = a[:, i], a[:, j]
            m = (p + q) / 2
            out[i, j] = (0.5 * plogp(p).sum(-1) + 0.5 * plogp(q).sum(-1) - plogp(m).sum(-1)).sum()
    return out


def test_distances_of_an_image_run_equal_numpy_from_eager_maps(tmp_path):
    model_dir = sharp_vit(tmp_path / "vit")
    paths = write_images(tmp_path / "images")
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["extract", "--model", str(model_dir), "--images", str(tmp_path / "images"),
                                    "-o", str(run), "-q"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["distances", str(run), "-q"])
    assert res.exit_code == 0, res.output
    dist = HeadDistances.load(run)
    assert dist.n_rows == len(paths) * (1 + (SIZE // PATCH) ** 2)  # [CLS] and 16 patches per image
    want = js_by_numpy(model_dir, paths)
    assert want.max() > 0.05  # the heads differ
    np.testing.assert_allclose(dist.total, want, rtol=1e-4, atol=1e-5)
    res = CliRunner().invoke(main, ["distances", str(run), "--overwrite", "--corpus", str(paths[0])])
    assert res.exit_code != 0 and "--corpus says which text to read" in res.output, res.output
