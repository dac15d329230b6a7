"""The labelled images of `attnkit ablate --task image-classification` (`--data`), read and checked without a model
and without torch (the command line reads them before torch is imported), through the image readers of
`attnkit extract --images` (attnkit/corpus/images.py). Two layouts (docs/interventions.md, "Image classification"):

* a folder of folders, one per label, as torchvision's ImageFolder reads them: DATA/cat/1.png, DATA/dog/a.jpg
  (each label folder is searched as `extract --images` searches a folder: recursively, other files skipped and
  counted, unreadable images skipped by name);
* a `datasets` directory (save_to_disk) with a column of images and a column of labels, as DIR:IMAGES (labels in
  column `label`) or DIR:IMAGES:LABELS. A ClassLabel column's labels are its names; a string column's, the
  strings; an integer column without names holds the model's class indices.

A label is mapped to the model's class by its config.json `label2id` (`label_ids`), and a label the model does not
know is refused by name before the model loads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..corpus.images import DatasetImagesSource, ImageFilesSource, ImageItem, image_extensions
from ..corpus.sources import is_datasets_dir
from ..errors import AttnkitError

LABEL_COLUMN = "label"  # the labels of DIR:IMAGES
DEFAULT_TEMPLATE = "a photo of a {}."  # zero-shot-image: a class's prompt, the class name in place of {}


@dataclass(frozen=True)
class LabelledImages:
    """Images and their labels (a name, or the model's class index where the data gives indices only); `source`:
    how the data was read, for messages."""

    items: list  # ImageItem
    labels: list  # str or int, one per item
    source: str

    def __len__(self) -> int:
        return len(self.items)


def _split_data(path: str) -> tuple[str, str | None, str | None]:
    """(directory, image column, label column) of --data: a folder of label folders has no columns."""
    if os.path.exists(path) and not is_datasets_dir(path):
        return path, None, None
    parts = path.split(":")
    for k in (2, 1):  # DIR:IMAGES:LABELS, then DIR:IMAGES
        if len(parts) > k and is_datasets_dir(":".join(parts[:-k])):
            cols = parts[-k:]
            return ":".join(parts[:-k]), cols[0], cols[1] if k == 2 else LABEL_COLUMN
    if is_datasets_dir(path):
        raise AttnkitError(f"{path!r} is a datasets directory: name its image column (and its label column, "
                           f"default {LABEL_COLUMN!r}), as {path}:IMAGES or {path}:IMAGES:LABELS")
    raise AttnkitError(f"image data {path!r} does not exist (give a folder with one folder of images per label, or "
                       "DATASET_DIR:IMAGES[:LABELS])")


def read_labelled_images(path) -> LabelledImages:
    """The labelled images of `path` (module docstring); at least one, refused by name otherwise."""
    path = str(path)
    folder, images, labels = _split_data(path)
    if images is None:
        return _read_folders(folder)
    return _read_dataset(folder, images, labels)


def _read_folders(folder: str) -> LabelledImages:
    if not os.path.isdir(folder):
        raise AttnkitError(f"image data {folder!r} is a file: give a folder with one folder of images per label "
                           "(DATA/cat/1.png, DATA/dog/2.png), or DATASET_DIR:IMAGES[:LABELS]")
    entries = sorted(e for e in os.listdir(folder) if not e.startswith("."))
    known = image_extensions()
    loose = [e for e in entries if os.path.isfile(os.path.join(folder, e)) and Path(e).suffix.lower() in known]
    if loose:
        raise AttnkitError(f"{os.path.join(folder, loose[0])}: an image outside a label folder; put every image in "
                           f"the folder of its label ({folder}/LABEL/{loose[0]})")
    label_dirs = [e for e in entries if os.path.isdir(os.path.join(folder, e))]
    if not label_dirs:
        raise AttnkitError(f"image folder {folder!r} holds no label folders: give one folder of images per label "
                           f"({folder}/cat/1.png, {folder}/dog/2.png)")
    items, labels = [], []
    for label in label_dirs:
        for f in ImageFilesSource(os.path.join(folder, label)).plan()["files"]:
            items.append(ImageItem(f, path=f))
            labels.append(label)
    return LabelledImages(items, labels, f"{folder} ({len(label_dirs)} label folders)")


def _read_dataset(folder: str, images: str, label_column: str) -> LabelledImages:
    import datasets

    try:
        ds = datasets.load_from_disk(folder)
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid, ...
        raise AttnkitError(f"{folder}: cannot load the datasets directory ({str(exc).splitlines()[0]})") from None
    if not isinstance(ds, datasets.Dataset):
        raise AttnkitError(f"{folder}: a DatasetDict of splits ({', '.join(ds)}); give the directory of one split")
    if label_column not in ds.features:
        raise AttnkitError(f"{folder}: no label column {label_column!r}; columns are: {', '.join(ds.features)} "
                           f"(name it as {folder}:{images}:LABELS)")
    feature = ds.features[label_column]
    values = ds[label_column]
    if isinstance(feature, datasets.ClassLabel):
        labels = [None if v is None or v < 0 else feature.names[v] for v in values]
    elif str(getattr(feature, "dtype", "")).startswith(("string", "large_string", "int", "uint")):
        labels = list(values)
    else:
        raise AttnkitError(f"{folder}: label column {label_column!r} holds {feature}, not class names or indices")
    missing = [i for i, v in enumerate(labels) if v is None]
    if missing:
        raise AttnkitError(f"{folder}[row {missing[0]}]: no label ({len(missing)} row(s) without one)")
    source = DatasetImagesSource(folder, images)
    items = list(source.segments())
    return LabelledImages(items, labels, f"{folder}:{images} (labels: {label_column})")


def check_classifier(config: dict | None, model: str) -> None:
    """Refuse, from config.json before the model loads, a model that takes no images and a vision transformer
    without an image-classification head (transformers would load one with a random head)."""
    from ..run.model_dir import check_model_takes

    check_model_takes(None if model == "default" else model, images=True)
    archs = [str(a) for a in (config or {}).get("architectures") or []]
    if not any(a.endswith("ForImageClassification") or a.endswith("ForImageClassificationWithTeacher")
               for a in archs):
        mtype = (config or {}).get("model_type")
        held = f"a {archs[0]}" if archs else f"a {mtype!r} model that names no architecture"
        raise AttnkitError(f"{model!r} holds {held}, which has no image-classification head: image-classification "
                           "needs a model fine-tuned to classify images (e.g. ViTForImageClassification)")


def read_regions(regions):
    """The image regions of `attnkit ablate --regions` (docs/interventions.md, "Regions of an image"): None,
    "quadrants", or a .npy file of one map of non-negative integer region ids (H × W), checked here."""
    if regions is None or regions == "quadrants":
        return regions
    import numpy as np

    if not str(regions).endswith(".npy") or not os.path.isfile(regions):
        raise AttnkitError(f"image regions {regions!r}: give 'quadrants' or a .npy file of region ids (H × W)")
    try:
        m = np.load(regions, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise AttnkitError(f"{regions}: cannot read the region map ({exc})") from None
    if m.ndim != 2 or m.dtype.kind not in "iu" or min(m.shape) < 1 or (m < 0).any():
        raise AttnkitError(f"{regions}: a region map is one H × W array of non-negative integers, got {m.dtype} of "
                           f"shape {m.shape}")
    return m


def check_two_towers(config: dict | None, model: str) -> None:
    """Refuse, from config.json before it loads, a model without a text and a vision tower (zero-shot-image)."""
    cfg = config or {}
    if cfg.get("vision_config") is None or cfg.get("text_config") is None:
        raise AttnkitError(f"{model!r} holds a {cfg.get('model_type')!r} model without a vision and a text tower: "
                           "zero-shot-image needs an image–text model such as CLIP or SigLIP")


def zero_shot_classes(data: LabelledImages, labels=None, template: str | None = None) -> tuple[list, list]:
    """(classes, their prompts) of zero-shot-image: `labels` (a list, or names separated by commas; default the
    data's labels, sorted), each prompt `template` (default DEFAULT_TEMPLATE) with the class in place of {}. A label
    of the data that is no class is refused by name."""
    template = DEFAULT_TEMPLATE if template is None else template
    if "{}" not in template:
        raise AttnkitError(f"the prompt template {template!r} has no {{}} for the class name")
    names = [str(label) for label in data.labels]
    if isinstance(labels, str):
        labels = [c.strip() for c in labels.split(",") if c.strip()]
    classes = list(dict.fromkeys(labels)) if labels else sorted(set(names))
    unknown = sorted(set(names) - set(classes))
    if unknown:
        raise AttnkitError(f"{data.source}: label(s) {', '.join(map(repr, unknown[:5]))} are none of the classes "
                           f"given ({', '.join(map(repr, classes[:8]))})")
    return classes, [template.format(c) for c in classes]


def label_ids(data: LabelledImages, config: dict | None, model: str) -> list[int]:
    """The model's class index of every label of `data`, from `config` (config.json as a dict): a name through
    its label2id, an index checked against num_labels. A label the model does not know is refused by name."""
    config = config or {}
    label2id = {str(k): int(v) for k, v in (config.get("label2id") or {}).items()}
    n = len(config.get("id2label") or label2id) or config.get("num_labels")
    out, unknown = [], []
    for label in data.labels:
        if isinstance(label, str):
            if label not in label2id:
                unknown.append(label)
                continue
            out.append(label2id[label])
        else:
            if n is not None and not 0 <= int(label) < int(n):
                raise AttnkitError(f"{data.source}: label {label} is no class index of {model!r}, which has {n} "
                                   "classes")
            out.append(int(label))
    if unknown:
        names = sorted(set(unknown))
        raise AttnkitError(f"{data.source}: label(s) {', '.join(map(repr, names[:5]))}"
                           f"{' ...' if len(names) > 5 else ''} are not classes of {model!r} (its config.json "
                           f"label2id names {', '.join(map(repr, list(label2id)[:8]))}"
                           f"{' ...' if len(label2id) > 8 else ''})")
    return out


__all__ = ["DEFAULT_TEMPLATE", "LABEL_COLUMN", "LabelledImages", "check_classifier", "check_two_towers", "label_ids",
           "read_labelled_images", "read_regions", "zero_shot_classes"]
