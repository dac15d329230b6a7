"""`attnkit ablate --task image-classification` (issue 49 item 4) on a tiny random ViT classifier saved with its image
processor into a temporary directory, with labelled random images written here (a folder of label folders, and a
`datasets` directory with an image and a label column). Every head's Δaccuracy and Δloss of the heads experiment
equal a forward of the plain transformers model (eager attention, no attnkit) with that head's output zeroed at its
output projection; Michel's importance equals |∂L/∂gate| from gates on the same eager model; the bootstrap
intervals hold their deltas; labels, models and options that do not fit are refused by name before a model loads."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

import transformers as T  # noqa: E402
from PIL import Image  # noqa: E402

from attnkit.ablation.image_data import read_labelled_images  # noqa: E402
from attnkit.ablation.job import run_ablation  # noqa: E402
from attnkit.ablation.options import AblateOptions, preflight_ablate  # noqa: E402
from attnkit.errors import AttnkitError  # noqa: E402

SIZE, PATCH = 32, 8
LABELS = ("bird", "cat", "dog")
SMALL = dict(image_size=SIZE, patch_size=PATCH, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=32, initializer_range=0.5)


def save_classifier(path, head: bool = True):
    """A tiny random ViT (with a classification head of LABELS, or the bare model) and its image processor."""
    torch.manual_seed(0)
    cfg = T.ViTConfig(**SMALL, id2label=dict(enumerate(LABELS)), label2id={k: i for i, k in enumerate(LABELS)})
    model = T.ViTForImageClassification(cfg) if head else T.ViTModel(cfg)
    model.eval().save_pretrained(path)
    T.ViTImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("vitc"))


def write_folders(root, per_label: int = 3, labels=LABELS):
    """Random RGB images in root/<label>/; returns (paths, labels) in the order they are read (sorted)."""
    rng = np.random.default_rng(1)
    paths, names = [], []
    for label in sorted(labels):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_label):
            p = root / label / f"{i}.png"
            Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(p)
            paths.append(str(p))
            names.append(label)
    return paths, names


def eager_outputs(model_dir, paths, gold, zero=(), gates=None):
    """(accuracy ×100, mean cross-entropy, per-image predictions) of the plain transformers model on `paths`, with
    the heads `zero` [(layer, head)] zeroed and `gates` (layers × heads, requires grad) multiplying each head's
    output, both at the input of the layer's output projection; also the per-image losses."""
    processor = T.AutoImageProcessor.from_pretrained(model_dir)
    model = T.ViTForImageClassification.from_pretrained(model_dir, attn_implementation="eager").eval()
    H, D = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    handles = []
    for layer, block in enumerate(model.vit.layers):
        def gate(module, args, layer=layer):
            x = args[0].unflatten(-1, (H, D))
            scale = torch.ones(H, dtype=x.dtype) if gates is None else gates[layer].to(x.dtype)
            for lay, head in zero:
                if lay == layer:
                    scale = scale * torch.tensor([0.0 if h == head else 1.0 for h in range(H)], dtype=x.dtype)
            return ((x * scale[:, None]).flatten(-2),)
        handles.append(block.attention.o_proj.register_forward_pre_hook(gate))
    images = [Image.open(p).convert("RGB") for p in paths]
    px = torch.from_numpy(np.asarray(processor(images=images, return_tensors="np")["pixel_values"]))
    try:
        with torch.set_grad_enabled(gates is not None):
            logits = model(pixel_values=px).logits.double()
    finally:
        for h in handles:
            h.remove()
    y = torch.tensor([LABELS.index(g) for g in gold])
    nll = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    acc = 100.0 * float((logits.argmax(-1) == y).double().mean())
    return acc, nll, logits.argmax(-1)


def ablate(tmp_path, model_dir, data, experiment="heads", task="image-classification", **kw):
    opts = AblateOptions(model=str(model_dir), task_name=task, data=str(data),
                         experiment=experiment, out=str(tmp_path / f"out-{experiment}"), device="cpu", quiet=True,
                         batch_size=4, **kw)
    preflight_ablate(opts)
    return run_ablation(opts)


def test_each_heads_deltas_equal_eagers_forward_with_that_head_zeroed(vit_dir, tmp_path):
    paths, gold = write_folders(tmp_path / "imgs")
    res = ablate(tmp_path, vit_dir, tmp_path / "imgs", resamples=200)
    rows = res.table.rows
    assert [r["setting"] for r in rows] == ["baseline", "L0H0 zero", "L0H1 zero", "L1H0 zero", "L1H1 zero"]
    base_acc, base_nll, _ = eager_outputs(vit_dir, paths, gold)
    assert rows[0]["accuracy"] == pytest.approx(base_acc) and rows[0]["n"] == len(paths)
    assert rows[0]["loss"] == pytest.approx(float(base_nll.mean()), rel=1e-5)
    moved = 0
    for row in rows[1:]:
        acc, nll, _ = eager_outputs(vit_dir, paths, gold, zero=[(row["layer"], row["head"])])
        assert row["accuracy"] == pytest.approx(acc), row["setting"]
        assert row["loss"] == pytest.approx(float(nll.mean()), rel=1e-5), row["setting"]
        assert row["delta_accuracy"] == pytest.approx(acc - base_acc)
        moved += abs(float(nll.mean() - base_nll.mean())) > 1e-3
        # the paired interval holds the change (a percentile interval of resampled changes)
        assert row["delta_accuracy_lo"] <= row["delta_accuracy"] + 1e-9 <= row["delta_accuracy_hi"] + 2e-9
    assert moved >= 2  # the heads matter to this model, so the comparison can fail
    assert rows[0]["delta_accuracy_lo"] == rows[0]["delta_accuracy_hi"] == 0
    meta = json.loads((tmp_path / "out-heads" / "heads.meta.json").read_text())
    assert meta["task"] == "image-classification" and meta["n_examples"] == len(paths)
    assert meta["bootstrap"]["resamples"] == 200
    # the per-image file: every setting's prediction, gold class and cross-entropy of each image
    import pandas as pd

    ex = pd.read_csv(tmp_path / "out-heads" / "heads.examples.csv")
    base = ex[ex.setting == "baseline"].sort_values("example")
    np.testing.assert_allclose(base["nll"], base_nll.numpy(), rtol=1e-5)
    assert list(base["gold"]) == [LABELS.index(g) for g in gold]


def test_importance_is_the_gate_gradient_of_each_images_loss(vit_dir, tmp_path):
    paths, gold = write_folders(tmp_path / "imgs", per_label=2)
    res = ablate(tmp_path, vit_dir, tmp_path / "imgs", experiment="importance", resamples=0, step=0.25,
                 no_layer_norm=True)
    table = res.table
    raw = np.asarray(table.extra["importance_raw"])
    want = np.zeros((2, 2))
    for p, g in zip(paths, gold):  # one image at a time, as Michel et al. average |∂L(x)/∂ξ|
        gates = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
        _, nll, _ = eager_outputs(vit_dir, [p], [g], gates=gates)
        (grad,) = torch.autograd.grad(nll.sum(), gates)
        want += grad.abs().numpy() / len(paths)
    np.testing.assert_allclose(raw, want, rtol=1e-4, atol=1e-7)
    assert table.extra["importance_n"] == len(paths)
    assert [r["pruned"] for r in table.rows] == [0, 1, 2, 3, 4]
    last = table.rows[-1]  # every head pruned: the model as eager with all heads zeroed
    acc, nll, _ = eager_outputs(vit_dir, paths, gold, zero=[(l, h) for l in range(2) for h in range(2)])
    assert last["loss"] == pytest.approx(float(nll.mean()), rel=1e-5) and last["accuracy"] == pytest.approx(acc)
    # the pruned models' sizes (a ViT is pruned physically): a head's projections gone with each step
    params = [r["params"] for r in table.rows]
    assert all(a > b for a, b in zip(params, params[1:])), params
    assert all(r["flops_per_token"] > 0 for r in table.rows)


def test_a_datasets_directory_with_names_or_indices_reads_as_the_folders(vit_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    paths, gold = write_folders(tmp_path / "imgs", per_label=2)
    rows = {"img": [{"path": p, "bytes": None} for p in paths], "label": gold, "cls": [LABELS.index(g) for g in gold]}
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("string"),
                                  "cls": datasets.ClassLabel(names=list(LABELS))})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    data = read_labelled_images(f"{tmp_path / 'ds'}:img")
    assert data.labels == gold and len(data) == len(paths)
    assert read_labelled_images(f"{tmp_path / 'ds'}:img:cls").labels == gold  # ClassLabel: its names
    folders = ablate(tmp_path / "a", vit_dir, tmp_path / "imgs", resamples=0).table.rows
    named = ablate(tmp_path / "b", vit_dir, f"{tmp_path / 'ds'}:img:cls", resamples=0).table.rows
    for a, b in zip(folders, named):
        assert a["accuracy"] == pytest.approx(b["accuracy"]) and a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    with pytest.raises(AttnkitError, match="no label column 'kind'; columns are: img, label, cls"):
        read_labelled_images(f"{tmp_path / 'ds'}:img:kind")
    with pytest.raises(AttnkitError, match="column 'cls' holds ClassLabel.*not images"):
        read_labelled_images(f"{tmp_path / 'ds'}:cls")
    with pytest.raises(AttnkitError, match="name its image column"):
        read_labelled_images(str(tmp_path / "ds"))


def preflight(tmp_path, model_dir, data, **kw):
    opts = dict(model=str(model_dir), task_name="image-classification", data=str(data), experiment="heads",
                out=str(tmp_path / "out"), device="cpu", quiet=True)
    opts.update(kw)
    return preflight_ablate(AblateOptions(**opts))


def test_what_does_not_fit_is_refused_by_name_before_a_model_loads(vit_dir, tmp_path):
    from .synthetic import tiny_bert

    write_folders(tmp_path / "imgs", per_label=1)
    bert = tmp_path / "bert"
    model, tok = tiny_bert()
    model.save_pretrained(bert)
    tok.save_pretrained(bert)
    with pytest.raises(AttnkitError, match="is a text model .*takes no images"):
        preflight(tmp_path, bert, tmp_path / "imgs")
    bare = save_classifier(tmp_path / "bare", head=False)
    with pytest.raises(AttnkitError, match="holds a ViTModel, which has no image-classification head"):
        preflight(tmp_path, bare, tmp_path / "imgs")
    with pytest.raises(AttnkitError, match="vision transformer, which takes images: use .*image-classification"):
        (tmp_path / "texts.txt").write_text("a text\nanother text\n")
        preflight(tmp_path, vit_dir, tmp_path / "texts.txt", task_name="mlm")
    write_folders(tmp_path / "odd", per_label=1, labels=("cat", "zebra"))
    with pytest.raises(AttnkitError, match=r"label\(s\) 'zebra' are not classes of .*'bird', 'cat', 'dog'"):
        preflight(tmp_path, vit_dir, tmp_path / "odd")
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (SIZE, SIZE)).save(tmp_path / "flat" / "x.png")
    with pytest.raises(AttnkitError, match="an image outside a label folder"):
        preflight(tmp_path, vit_dir, tmp_path / "flat")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AttnkitError, match="holds no label folders"):
        preflight(tmp_path, vit_dir, tmp_path / "empty")
    with pytest.raises(AttnkitError, match="does not exist"):
        preflight(tmp_path, vit_dir, tmp_path / "missing")
    with pytest.raises(AttnkitError, match="mode.*mean.* is not for .*image-classification.*means are measured over texts"):
        preflight(tmp_path, vit_dir, tmp_path / "imgs", mode="mean")
    with pytest.raises(AttnkitError, match="max.length.* is not for .*image-classification.*no tokens to cut"):
        preflight(tmp_path, vit_dir, tmp_path / "imgs", max_length=64)
    assert not (tmp_path / "out").exists()


def save_two_towers(path, kind: str = "clip"):
    """A tiny random CLIP or SigLIP (both towers) with a word-level tokenizer and an image processor of SIZE
    pixels."""
    from .synthetic import tiny_bert

    _, tok = tiny_bert()
    torch.manual_seed(0)
    text = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                vocab_size=len(tok), max_position_embeddings=32, eos_token_id=tok.sep_token_id)
    vision = {k: v for k, v in SMALL.items() if k != "initializer_range"}
    if kind == "clip":
        model = T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8,
                                         initializer_factor=5.0))
    else:
        model = T.SiglipModel(T.SiglipConfig(text_config=text, vision_config=vision, initializer_factor=5.0))
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    T.CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_two_towers(tmp_path_factory.mktemp("clip"))


def clip_logits(model_dir, paths, prompts, zero=()):
    """The image–text logits of the plain transformers CLIP (eager, no attnkit), the vision heads `zero` zeroed at
    their output projection."""
    from attnkit.ablation.image_tasks import prompt_padding

    model = T.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    tok = T.AutoTokenizer.from_pretrained(model_dir)
    processor = T.AutoImageProcessor.from_pretrained(model_dir)
    vision = model.vision_model
    H = vision.config.num_attention_heads
    handles = []
    blocks = vision.encoder.layers if hasattr(vision, "encoder") else vision.layers
    for layer, block in enumerate(blocks):
        heads = [h for lay, h in zero if lay == layer]
        if heads:
            def gate(module, args, heads=heads):
                x = args[0].unflatten(-1, (H, -1)).clone()
                x[..., heads, :] = 0
                return (x.flatten(-2),)
            handles.append(block.self_attn.out_proj.register_forward_pre_hook(gate))
    px = torch.from_numpy(np.asarray(processor(images=[Image.open(p).convert("RGB") for p in paths],
                                               return_tensors="np")["pixel_values"]))
    with torch.no_grad():
        out = model(pixel_values=px, **tok(prompts, **prompt_padding(model.config), return_tensors="pt"))
    for h in handles:
        h.remove()
    return out.logits_per_image.double()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_zero_shot_deltas_equal_the_models_own_logits_with_a_vision_head_zeroed(kind, clip_dir, tmp_path):
    if kind == "siglip":
        clip_dir = save_two_towers(tmp_path / "siglip", "siglip")
    paths, gold = write_folders(tmp_path / "imgs", per_label=2)
    classes = ["dog", "cat", "bird", "fish"]  # a class no image has, and the order given
    template = "a {} here"
    rows = ablate(tmp_path, clip_dir, tmp_path / "imgs", task="zero-shot-image", resamples=100,
                  labels=",".join(classes), template=template).table.rows
    prompts = [template.format(c) for c in classes]
    y = torch.tensor([classes.index(g) for g in gold])
    moved = 0
    base = None
    for row in rows:
        zero = [] if row["layer"] is None else [(row["layer"], row["head"])]
        logits = clip_logits(clip_dir, paths, prompts, zero)
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        acc = 100.0 * float((logits.argmax(-1) == y).double().mean())
        assert row["loss"] == pytest.approx(loss, rel=1e-5), row["setting"]
        assert row["accuracy"] == pytest.approx(acc), row["setting"]
        base = loss if base is None else base
        moved += abs(loss - base) > 1e-3
        assert row["delta_accuracy_lo"] <= row["delta_accuracy"] + 1e-9 <= row["delta_accuracy_hi"] + 2e-9
    assert len(rows) == 5 and moved >= 2
    with pytest.raises(AttnkitError, match=r"label\(s\) 'dog' are none of the classes given \('bird', 'cat'\)"):
        preflight(tmp_path, clip_dir, tmp_path / "imgs", task_name="zero-shot-image", labels="bird,cat")
    with pytest.raises(AttnkitError, match="has no {} for the class name"):
        preflight(tmp_path, clip_dir, tmp_path / "imgs", task_name="zero-shot-image", template="a photo")
    with pytest.raises(AttnkitError, match="without a vision and a text tower"):
        preflight(tmp_path, save_classifier(tmp_path / "vit"), tmp_path / "imgs", task_name="zero-shot-image")
    with pytest.raises(AttnkitError, match="labels.* is for .*zero-shot-image"):
        preflight(tmp_path, clip_dir, tmp_path / "imgs", labels="bird,cat")


def test_the_command_line_runs_the_layers_experiment_on_images(vit_dir, tmp_path):
    import csv

    from click.testing import CliRunner

    from attnkit.cli.ablate import ablate as ablate_command

    paths, gold = write_folders(tmp_path / "imgs", per_label=2)
    out = tmp_path / "out"
    res = CliRunner().invoke(ablate_command, [str(vit_dir), "--task", "image-classification", "--data",
                                              str(tmp_path / "imgs"), "--experiment", "layers", "--mode", "zero",
                                              "--out", str(out), "--resamples", "50", "--quiet", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "image-classification · layers (mode zero) · 6 examples" in res.output
    with open(out / "layers.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["setting"] for r in rows] == ["baseline", "L0 zero", "L1 zero"]
    for row in rows[1:]:
        layer = int(row["layer"])
        _, nll, _ = eager_outputs(vit_dir, paths, gold, zero=[(layer, 0), (layer, 1)])
        assert float(row["loss"]) == pytest.approx(float(nll.mean()), rel=1e-5)
    res = CliRunner().invoke(ablate_command, [str(vit_dir), "--task", "image-classification", "--data",
                                              str(tmp_path / "imgs"), "--experiment", "heads", "--labels", "a,b",
                                              "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--labels is for --task zero-shot-image" in res.output


def test_regions_of_the_images_reach_the_tasks_region_interventions(vit_dir, tmp_path):
    import attnkit
    from attnkit.ablation.experiments import TaskEvaluator
    from attnkit.ablation.image_tasks import ImageClassificationTask
    from attnkit.interventions import patch_regions

    paths, gold = write_folders(tmp_path / "imgs", per_label=2)
    model, processor = attnkit.load_model(str(vit_dir), device="cpu", task="image-classification")
    iv = attnkit.Intervention.for_model(model)
    iv.set(0, 1, region="no_inter").set(1, 0, region="no_intra")
    px = torch.from_numpy(np.asarray(processor(images=[Image.open(p).convert("RGB") for p in paths],
                                               return_tensors="np")["pixel_values"]))
    y = torch.tensor([LABELS.index(g) for g in gold])
    np.save(tmp_path / "halves.npy", (np.arange(SIZE)[None, :] >= SIZE // 2).repeat(SIZE, 0).astype(np.int64))
    for regions in ("quadrants", str(tmp_path / "halves.npy")):
        ids = patch_regions(model, regions if regions == "quadrants" else np.load(regions), batch=len(paths))
        with torch.no_grad(), attnkit.intervene(model, iv, sentences=ids):
            want = float(torch.nn.functional.cross_entropy(model(pixel_values=px).logits.double(), y))
        task = ImageClassificationTask(str(tmp_path / "imgs"), regions=regions)
        for sweep in (True, False):
            got = TaskEvaluator(task, model, processor, batch_size=4, sweep=sweep).evaluate_many([iv])[0][0]
            assert got["loss"] == pytest.approx(want, rel=1e-5), (regions, sweep)
    with torch.no_grad():
        plain = float(torch.nn.functional.cross_entropy(model(pixel_values=px).logits.double(), y))
    assert abs(want - plain) > 1e-3
    # without regions every image is one region: no_inter removes nothing
    alone = attnkit.Intervention.for_model(model).set(0, 1, region="no_inter")
    got = TaskEvaluator(ImageClassificationTask(str(tmp_path / "imgs")), model, processor)(alone)
    assert got["loss"] == pytest.approx(plain, rel=1e-5)
    with pytest.raises(AttnkitError, match="give 'quadrants' or a .npy file"):
        ImageClassificationTask(str(tmp_path / "imgs"), regions="halves")
    np.save(tmp_path / "bad.npy", np.zeros((4, 4)))
    with pytest.raises(AttnkitError, match="non-negative integers, got float64"):
        preflight(tmp_path, vit_dir, tmp_path / "imgs", regions=str(tmp_path / "bad.npy"))
    with pytest.raises(AttnkitError, match="regions.* is for the image tasks"):
        (tmp_path / "texts.txt").write_text("a text\n")
        preflight(tmp_path, vit_dir, tmp_path / "texts.txt", task_name="mlm", regions="quadrants")
