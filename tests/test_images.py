"""Images as a corpus (issue 49 item 3; docs/features.md §10, "Images as a corpus"): `attnkit extract --images` and
`attnkit.extract(images=...)` read image files, folders, a datasets image column and the embedded image set
(scikit-image's sample images) through the model's own image processor. Tiny random ViT and DINOv2-with-registers
directories saved here (weights and image processor) are measured; a sample's features equal the entropy and mean
attention distance computed here from eager's maps of the same pixels; grayscale, RGBA and images of another size are
converted, damaged files and non-images in a folder are skipped by name, a damaged file named alone is refused; an
interrupted run resumes to the numbers of an uninterrupted one; text for a vision model and images for a text model
are refused before a model loads."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("skimage")

import transformers as T  # noqa: E402
from PIL import Image  # noqa: E402

import attnkit  # noqa: E402
from attnkit.corpus.images import EMBEDDED_IMAGES, ImageItem, decode_image, open_images  # noqa: E402
from attnkit.errors import AttnkitError  # noqa: E402
from attnkit.features import IMAGE_FEATURES  # noqa: E402
from attnkit.jobs import extract_job  # noqa: E402
from attnkit.jobs.job_options import ExtractOptions, preflight_extract  # noqa: E402

SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, hidden_act="gelu")
SIZE, PATCH = 32, 8  # 4 × 4 patches


def save_model(path, kind: str):
    """A tiny random vision transformer with its image processor (32 × 32 images, 8-pixel patches) in `path`."""
    torch.manual_seed(0)
    if kind == "vit":
        model = T.ViTModel(T.ViTConfig(image_size=SIZE, patch_size=PATCH, intermediate_size=32, **SMALL))
    else:
        model = T.Dinov2WithRegistersModel(T.Dinov2WithRegistersConfig(
            image_size=SIZE, patch_size=PATCH, mlp_ratio=2, num_register_tokens=2, **SMALL))
    model.eval().save_pretrained(path)
    T.ViTImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("vit"), "vit")


@pytest.fixture(scope="module")
def dinov2_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("dinov2"), "dinov2")


def write_images(folder):
    """RGB, grayscale, RGBA and palette PNGs and a JPEG of other sizes than the model's, random pixels; returns
    their paths in the order a folder is read (sorted)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / "a_rgb.png")
    Image.fromarray(rng.integers(0, 256, (32, 32), dtype=np.uint8), "L").save(folder / "b_gray.png")
    Image.fromarray(rng.integers(0, 256, (24, 30, 4), dtype=np.uint8), "RGBA").save(folder / "c_rgba.png")
    Image.fromarray(rng.integers(0, 256, (64, 20, 3), dtype=np.uint8)).save(folder / "d_tall.jpg", quality=95)
    Image.fromarray(rng.integers(0, 256, (33, 17, 3), dtype=np.uint8)).convert("P").save(folder / "e_palette.png")
    return [str(folder / n) for n in ("a_rgb.png", "b_gray.png", "c_rgba.png", "d_tall.jpg", "e_palette.png")]


def pixels_of(model_dir, paths) -> torch.Tensor:
    """The images at `paths`, decoded here with Pillow and processed by the directory's image processor."""
    processor = T.AutoImageProcessor.from_pretrained(model_dir)
    images = [Image.open(p).convert("RGBA").convert("RGB") for p in paths]
    return torch.from_numpy(np.asarray(processor(images=images, return_tensors="np")["pixel_values"]))


def eager_image_maps(model_dir, paths) -> tuple:
    """Eager attention's maps (one B × H × L × L per layer) of the directory's model over the images at `paths`."""
    eager = T.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return eager(pixel_values=pixels_of(model_dir, paths), output_attentions=True).attentions


def expected_features(model_dir, paths, prefix: int) -> dict:
    """Per image, per layer and head: the mean row entropy and the mean attention distance (Σ over patch keys of
    weight × Euclidean distance of their grid positions, averaged over patch queries) from eager's maps, the images
    decoded here with Pillow and processed by the directory's image processor."""
    maps = eager_image_maps(model_dir, paths)
    side = SIZE // PATCH
    grid = torch.tensor([[i // side, i % side] for i in range(side * side)], dtype=torch.float64)
    d = torch.cdist(grid, grid)
    ent, mad = [], []
    for a in maps:
        a = a.double()
        ent.append((-torch.special.xlogy(a, a).sum(-1)).mean(-1))  # B × H
        mad.append((a[:, :, prefix:, prefix:] * d).sum(-1).mean(-1))
    return {"entropy": torch.stack(ent, 1).numpy(), "mean_attention_distance": torch.stack(mad, 1).numpy()}


def run_job(tmp_path, name, model_dir, paths, **kw):
    out = tmp_path / name
    opts = ExtractOptions(paths=[str(p) for p in paths], images=True, model_path=str(model_dir), out=out, device="cpu",
                          quiet=True, workers=0, threads=1, **kw)
    preflight_extract(opts)
    extract_job.run_extract_job(opts, echo=lambda *a, **k: None)
    return out


def features_of(run):
    with np.load(run / "features.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("kind, prefix", [("vit", 1), ("dinov2", 3)])
def test_a_folders_images_measure_as_eagers_maps_say(tmp_path, kind, prefix, request):
    model_dir = request.getfixturevalue(f"{kind}_dir")
    paths = write_images(tmp_path / "imgs")
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    run = run_job(tmp_path, "run", model_dir, [tmp_path / "imgs"], per_sample=True, batch_size=2)
    per_sample = np.load(run / "per_sample.npy")
    assert per_sample.shape[0] == len(paths)
    meta = json.loads((run / "meta.json").read_text())
    names = meta["feature_names"]
    want = expected_features(model_dir, paths, prefix)
    for f in ("entropy", "mean_attention_distance"):
        np.testing.assert_allclose(per_sample[..., names.index(f)], want[f], atol=1e-5, rtol=1e-5, err_msg=f)
    assert float(want["mean_attention_distance"].min()) > 0.1
    assert meta["inputs"][0]["n_skipped"] == 1 and meta["inputs"][0]["unreadable"] == []
    assert meta["n_segments"] == len(paths) and meta["settings"]["reading"]["images"] is True
    assert meta["n_tokens"] == len(paths) * (prefix + (SIZE // PATCH) ** 2)
    assert (run / "per_sample_rows.csv").read_text().count(".png") == 4  # each row names its image


def test_the_embedded_image_set_through_the_python_api(vit_dir):
    feats = attnkit.extract(images="embedded", model=str(vit_dir), device="cpu", per_sample=True)
    assert feats.n_samples == len(EMBEDDED_IMAGES) == feats.per_sample.shape[0]
    assert feats.names[-6:] == list(IMAGE_FEATURES)
    assert np.isfinite(feats.mean).all()
    # the same images given as one file each measure the same numbers
    again = attnkit.extract(images=open_images("embedded", limit=3), model=str(vit_dir), device="cpu",
                            per_sample=True)
    np.testing.assert_allclose(again.per_sample, feats.per_sample[:3], rtol=1e-6, atol=1e-6)


def test_modes_are_converted_to_rgb(tmp_path):
    paths = write_images(tmp_path / "imgs")
    for p in paths:
        img = decode_image(ImageItem(p, path=p))
        assert img.mode == "RGB" and img.size == Image.open(p).size
    gray = np.asarray(decode_image(ImageItem(paths[1], path=paths[1])))
    np.testing.assert_array_equal(gray[..., 0], np.asarray(Image.open(paths[1])))
    np.testing.assert_array_equal(gray[..., 0], gray[..., 2])


def damaged_png(path):
    good = tmp = path.with_suffix(".tmp.png")
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(tmp)
    data = bytearray(good.read_bytes())
    data[40:48] = b"\xff" * 8  # inside the first chunk: its checksum no longer holds
    path.write_bytes(bytes(data))
    tmp.unlink()


def test_a_damaged_image_in_a_folder_is_skipped_by_name_and_refused_when_named_alone(tmp_path, vit_dir):
    folder = tmp_path / "imgs"
    paths = write_images(folder)
    damaged_png(folder / "broken.png")
    (folder / "fake.jpg").write_bytes(b"this is no jpeg")
    corpus = open_images([folder])
    items = list(corpus)
    assert [i.path for i in items] == paths
    unreadable = corpus.describe()[0]["unreadable"]
    assert [u["path"] for u in unreadable] == [str(folder / "broken.png"), str(folder / "fake.jpg")]
    assert "not an image" in unreadable[1]["why"]
    assert "2 unreadable images skipped" in corpus.summary()
    for bad in ("broken.png", "fake.jpg"):
        with pytest.raises(AttnkitError, match=bad):
            list(open_images([folder / bad]))


def test_a_huge_image_is_refused_by_name(tmp_path, monkeypatch):
    from attnkit.corpus import images

    p = tmp_path / "big.png"
    Image.fromarray(np.zeros((50, 60, 3), dtype=np.uint8)).save(p)
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 50 * 60 - 1)
    with pytest.raises(AttnkitError, match=r"big.png: the image is 60×50 pixels, more than attnkit reads"):
        list(open_images([p]))
    with pytest.raises(AttnkitError, match=r"big.png: the image is 60×50 pixels"):
        decode_image(ImageItem(str(p), path=str(p)))


def test_a_datasets_image_column(tmp_path, vit_dir):
    datasets = pytest.importorskip("datasets")
    paths = write_images(tmp_path / "imgs")[:3]
    ds = datasets.Dataset.from_dict({"image": paths, "label": [0, 1, 2]}).cast_column("image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(AttnkitError, match="name its image column"):
        open_images([tmp_path / "ds"])
    with pytest.raises(AttnkitError, match="'label' holds .*not images"):
        list(open_images([f"{tmp_path / 'ds'}:label"]))
    items = list(open_images([f"{tmp_path / 'ds'}:image"]))
    assert [i.name for i in items] == [f"{tmp_path / 'ds'}[row {r}]" for r in range(3)]
    from_rows = attnkit.extract(images=f"{tmp_path / 'ds'}:image", model=str(vit_dir), device="cpu", per_sample=True)
    from_files = attnkit.extract(images=paths, model=str(vit_dir), device="cpu", per_sample=True)
    np.testing.assert_array_equal(from_rows.per_sample, from_files.per_sample)


def test_an_interrupted_image_run_resumes_to_the_numbers_of_an_uninterrupted_one(tmp_path, vit_dir, monkeypatch):
    folder = tmp_path / "imgs"
    write_images(folder)
    whole = features_of(run_job(tmp_path, "whole", vit_dir, [folder], batch_size=1))
    real_load = extract_job.load_model
    calls = []

    def load_then_interrupt(*a, **k):  # Ctrl-C inside the third forward
        model, processor = real_load(*a, **k)

        def hook(module, args, output):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt

        attnkit.models.attention_modules(model)[0].register_forward_hook(hook)
        return model, processor

    monkeypatch.setattr(extract_job, "load_model", load_then_interrupt)
    with pytest.raises(extract_job.Interrupted) as stopped:
        run_job(tmp_path, "part", vit_dir, [folder], batch_size=1, checkpoint_every=1)
    assert 0 < stopped.value.saved_after < 5  # a checkpoint of part of the images
    monkeypatch.setattr(extract_job, "load_model", real_load)
    resumed = features_of(run_job(tmp_path, "part", vit_dir, [folder], batch_size=1, checkpoint_every=1, resume=True))
    assert json.loads((tmp_path / "part" / "meta.json").read_text())["n_segments"] == 5
    np.testing.assert_allclose(resumed["mean"], whole["mean"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(resumed["std"], whole["std"], rtol=1e-9, atol=1e-12)


def test_images_for_a_text_model_and_text_for_a_vision_model_are_refused_before_loading(tmp_path, vit_dir,
                                                                                        monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(extract_job, "load_model", no_load)
    monkeypatch.setattr(attnkit.models, "load_model", no_load)
    corpus = tmp_path / "c.txt"
    corpus.write_text("A sentence.\n")
    with pytest.raises(AttnkitError, match=r"is a vision transformer \(vit\): it takes images, not text"):
        preflight_extract(ExtractOptions(paths=[str(corpus)], model_path=str(vit_dir), out=tmp_path / "r1"))
    with pytest.raises(AttnkitError, match=r"is a text model \(bert\): it takes no images"):
        preflight_extract(ExtractOptions(images=True, out=tmp_path / "r2"))
    with pytest.raises(AttnkitError, match="it takes images, not text"):
        attnkit.extract(["A sentence."], model=str(vit_dir))
    with pytest.raises(AttnkitError, match="it takes no images"):
        attnkit.extract(images="embedded")
    with pytest.raises(AttnkitError, match="says how to read text"):
        preflight_extract(ExtractOptions(images=True, columns=("text",), model_path=str(vit_dir),
                                         out=tmp_path / "r3"))
    with pytest.raises(AttnkitError, match="give texts or images, not both"):
        attnkit.extract(["A sentence."], images="embedded", model=str(vit_dir))


def test_an_instrumented_model_given_the_wrong_inputs_names_them(vit_dir):
    from attnkit.models import load_model

    model, processor = load_model(str(vit_dir), device="cpu")
    with pytest.raises(AttnkitError, match="takes images, not str"):
        attnkit.extract(["A sentence."], model=(model, processor))


@pytest.mark.slow
def test_extract_cluster_and_report_from_the_command_line(tmp_path, vit_dir):
    from click.testing import CliRunner

    from attnkit.cli.main import main as cli

    runner = CliRunner()
    run = tmp_path / "run"
    res = runner.invoke(cli, ["extract", "--images", "--model", str(vit_dir), "-o", str(run), "--device", "cpu",
                              "-q"])
    assert res.exit_code == 0, res.output
    meta = json.loads((run / "meta.json").read_text())
    assert meta["n_segments"] == len(EMBEDDED_IMAGES) and meta["inputs"][0]["format"] == "embedded images"
    for args in (["cluster", str(run)], ["report", str(run), "-q"]):
        res = runner.invoke(cli, args)
        assert res.exit_code == 0, res.output
    page = (run / "report.html").read_text()
    assert math.isfinite(features_of(run)["mean"].sum())
    # the two figures of image heads: distance against depth, and the [CLS] maps of the run's first image
    for stem in ("attention_distance_by_layer", "cls_attention_maps"):
        assert (run / "figures" / f"{stem}.png").stat().st_size > 0
    assert "Mean attention distance of each head" in page and "embedded:astronaut" in page
    assert page.count("data:image/png;base64,") >= 7


def test_the_cls_maps_are_the_models_cls_rows(vit_dir, tmp_path):
    """cls_attention_over_patches gives, per layer and head, eager's [CLS] row over the patches on the grid."""
    from attnkit.jobs.maps import cls_attention_over_patches
    from attnkit.models import load_model

    paths = write_images(tmp_path / "imgs")
    model, processor = load_model(str(vit_dir), device="cpu")
    maps, image = cls_attention_over_patches(ImageItem(paths[3], path=paths[3]), model, processor)
    px = torch.from_numpy(np.asarray(processor(images=[Image.open(paths[3]).convert("RGB")],
                                               return_tensors="np")["pixel_values"]))
    eager = T.AutoModel.from_pretrained(vit_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        want = torch.stack([a[0, :, 0, 1:] for a in eager(pixel_values=px, output_attentions=True).attentions])
    side = SIZE // PATCH
    assert maps.shape == (2, 2, side, side) and image.shape == (SIZE, SIZE, 3) and image.dtype == np.uint8
    np.testing.assert_allclose(maps.reshape(2, 2, -1), want.numpy(), atol=1e-6)
    np.testing.assert_allclose(maps[1, 0, 2, 3], want[1, 0, 2 * side + 3].item(), atol=1e-6)  # row-major grid


@pytest.mark.parametrize("kind, prefix", [("vit", 1), ("dinov2", 3)])
def test_an_image_processor_of_another_size_than_the_config_runs_through_interpolated_positions(tmp_path, kind,
                                                                                                prefix):
    """A processor making 48 × 24 images for a 32 × 32 config (as DINOv2's 224 for 518): a 6 × 3 grid, through the
    model's interpolated position embeddings (ViT asks for interpolate_pos_encoding, DINOv2 always interpolates);
    the features are eager's of the same pixels."""
    model_dir = save_model(tmp_path / kind, kind)
    T.ViTImageProcessor(size={"height": 48, "width": 24}).save_pretrained(model_dir)
    paths = write_images(tmp_path / "imgs")[:2]
    feats = attnkit.extract(images=paths, model=str(model_dir), device="cpu", per_sample=True)
    processor = T.AutoImageProcessor.from_pretrained(model_dir)
    px = torch.from_numpy(np.asarray(processor(images=[Image.open(p).convert("RGB") for p in paths],
                                               return_tensors="np")["pixel_values"]))
    assert px.shape[-2:] == (48, 24)
    eager = T.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    kw = {"interpolate_pos_encoding": True} if kind == "vit" else {}
    with torch.no_grad():
        maps = eager(pixel_values=px, output_attentions=True, **kw).attentions
    grid = torch.tensor([[i // 3, i % 3] for i in range(18)], dtype=torch.float64)
    d = torch.cdist(grid, grid)
    want = torch.stack([(a.double()[:, :, prefix:, prefix:] * d).sum(-1).mean(-1) for a in maps], 1).numpy()
    got = feats.per_sample[..., feats.names.index("mean_attention_distance")]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert feats.n_tokens == 2 * (prefix + 18)
