"""Images as a corpus (docs/features.md §10, "Images as a corpus"): image files, folders of them (searched
recursively), a column of images in a `datasets` directory (DIR:COLUMN), or the embedded image set. Each input is a
`Source` of the text pipeline whose segments are `ImageItem`s, so the `Corpus` of attnkit/corpus/inputs.py streams,
limits, describes and fingerprints them as it does text, and a run resumes at the same sample.

An ImageItem names its image (the file's path, `DIR[row N]`, `embedded:astronaut`) and is decoded where the batch is
built (attnkit/pixels.py, in the tokenising workers): Pillow reads it, grayscale, palette, CMYK and RGBA (its alpha
dropped) images are converted to RGB, a file Pillow cannot read is refused naming it, and so is an image of more than
MAX_IMAGE_PIXELS pixels (a decompression bomb, or a scan too large to hold decoded). In a folder, files whose
extension is no image format Pillow knows are skipped and counted (`n_skipped`), and image files that cannot be read
(not an image, damaged, too large: `image_problem`, checked when the folder is listed, before any is measured) are
skipped by name (`unreadable`, each with why); meta.json's inputs record both, and a resume lists the same files.
A file named on its own must be a readable image, or the run is refused naming it.

The embedded image set is scikit-image's bundled sample images (`skimage.data`, the optional extra
`attnkit[vision]`): EMBEDDED_IMAGES, the ones shipped inside the package (no download).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import AttnkitError
from .sources import Source, is_datasets_dir
from .streams import hash_files

EMBEDDED = "embedded"  # the name of the embedded image set as an input
# scikit-image's sample images inside its package (skimage.data; those that need pooch are left out): colour,
# grayscale (camera, coins, moon) and RGBA (logo)
EMBEDDED_IMAGES = ("astronaut", "camera", "chelsea", "coffee", "coins", "logo", "moon", "rocket")
# Pillow's own limit (Image.MAX_IMAGE_PIXELS, about 89 million pixels: 8,192 × 10,922); an image above it is refused
MAX_IMAGE_PIXELS = 89_478_485
# a nominal text length of one image for the plan (attnkit/engine/plan.py groups batches by characters): every image
# of a run has the same number of tokens, so this only decides how many batches a planned unit holds
IMAGE_CHARS = 16384


@dataclass(frozen=True)
class ImageItem:
    """One image of a corpus: `name` (how messages and the run name it), and where it is: a file `path`, a row of a
    datasets directory (`dataset`, `column`, `row`), or an embedded image (`embedded`, a name in EMBEDDED_IMAGES)."""

    name: str
    path: str | None = None
    dataset: str | None = None
    column: str | None = None
    row: int | None = None
    embedded: str | None = None

    chars = IMAGE_CHARS


def absolute_item(item: ImageItem) -> ImageItem:
    """`item` with its file or datasets directory as an absolute path: read the same from a process that runs in
    another working directory (a Ray worker). Its name, which messages show, is kept."""
    import dataclasses

    return dataclasses.replace(item, path=item.path and os.path.abspath(item.path),
                               dataset=item.dataset and os.path.abspath(item.dataset))


def image_extensions() -> frozenset:
    """The file extensions Pillow reads (lower case, with the dot)."""
    from PIL import Image

    Image.init()
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise AttnkitError("reading images needs Pillow (pip install 'attnkit[vision]')") from None
    return Image


def _opened(item: ImageItem):
    """The image of `item`, opened (lazily, as Pillow opens) from its file, dataset row or the embedded set."""
    Image = _pillow()
    if item.embedded is not None:
        return Image.fromarray(embedded_array(item.embedded))
    if item.dataset is not None:
        cell = _dataset_column(item.dataset, item.column)[item.row]
        if cell is None:
            raise AttnkitError(f"{item.name}: the image is missing (null)")
        data, path = cell.get("bytes"), cell.get("path")
        if data is None and not path:
            raise AttnkitError(f"{item.name}: the row holds neither image bytes nor a path")
        import io

        return Image.open(io.BytesIO(data) if data is not None else path)
    return Image.open(item.path)


def decode_image(item: ImageItem):
    """The image of `item` as an RGB PIL image (module docstring): refused naming it when Pillow cannot read it, when
    it has more than MAX_IMAGE_PIXELS pixels, or when its file is unreadable."""
    Image = _pillow()
    try:
        with _opened(item) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                raise AttnkitError(f"{item.name}: the image is {w}×{h} pixels, more than attnkit reads "
                                   f"({MAX_IMAGE_PIXELS:,}); scale it down first")
            img.load()
            if img.mode == "RGB":
                return img.copy()
            if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
                return img.convert("RGBA").convert("RGB")  # the alpha channel is dropped
            if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit grayscale: to 8 bits before RGB
                import numpy as np

                a = np.asarray(img, dtype=np.float64)
                top = float(a.max()) or 1.0
                return Image.fromarray((a / top * 255).astype(np.uint8)).convert("RGB")
            return img.convert("RGB")
    except AttnkitError:
        raise
    except Image.DecompressionBombError:
        raise AttnkitError(f"{item.name}: the image has more pixels than attnkit reads ({MAX_IMAGE_PIXELS:,}); scale "
                           "it down first") from None
    except Image.UnidentifiedImageError:
        raise AttnkitError(f"{item.name}: not an image Pillow can read") from None
    except FileNotFoundError:
        raise AttnkitError(f"{item.name}: the image file does not exist (any more)") from None
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt image data
        raise AttnkitError(f"{item.name}: cannot decode the image ({exc})") from None


def image_problem(path: str) -> str | None:
    """Why the file `path` is no image attnkit reads (None: it is one), from its header and, where the format has
    them, its checksums (PIL's `verify`): not an image Pillow knows, more than MAX_IMAGE_PIXELS pixels, or damaged.
    Data cut short inside a JPEG's pixels is found only when it is decoded (`decode_image`, naming the file)."""
    Image = _pillow()
    try:
        with Image.open(path) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                return f"the image is {w}×{h} pixels, more than attnkit reads ({MAX_IMAGE_PIXELS:,})"
            img.verify()
    except Image.DecompressionBombError:
        return f"the image has more pixels than attnkit reads ({MAX_IMAGE_PIXELS:,})"
    except Image.UnidentifiedImageError:
        return "not an image Pillow can read"
    except (OSError, SyntaxError, ValueError) as exc:
        return f"a damaged image ({exc})"
    return None


def embedded_array(name: str):
    """The embedded image `name` (EMBEDDED_IMAGES) as scikit-image gives it (H×W or H×W×C uint8)."""
    if name not in EMBEDDED_IMAGES:
        raise AttnkitError(f"no embedded image {name!r}; they are: {', '.join(EMBEDDED_IMAGES)}")
    try:
        import skimage.data
    except ImportError:
        raise AttnkitError("the embedded image set is scikit-image's sample images: pip install 'attnkit[vision]' "
                           "(scikit-image)") from None
    return getattr(skimage.data, name)()


_open_columns: dict = {}


def _dataset_column(path: str, column: str):
    """The column `column` of the datasets directory `path`, its images undecoded ({"bytes", "path"} per row),
    loaded once per process (a tokenising worker reads many rows of it)."""
    key = (path, column)
    if key not in _open_columns:
        _open_columns[key] = _load_dataset_column(path, column)
    return _open_columns[key]


def _load_dataset_column(path: str, column: str):
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid, ...
        raise AttnkitError(f"{path}: cannot load the datasets directory ({str(exc).splitlines()[0]})") from None
    if column not in ds.features:
        raise AttnkitError(f"{path}: no column {column!r}; columns are: {', '.join(ds.features)}")
    if not isinstance(ds.features[column], datasets.Image):
        raise AttnkitError(f"{path}: column {column!r} holds {ds.features[column]}, not images")
    return ds.cast_column(column, datasets.Image(decode=False))[column]


class ImageSource(Source):
    """An input of images: its segments are ImageItems (no blank ones to skip)."""

    def segments(self):
        yield from self._read(self.plan())

    @property
    def reading_path(self) -> str:
        """The input as `image_sources` takes it again (meta.json settings.reading.paths)."""
        return str(Path(self.path).resolve())


class ImageFilesSource(ImageSource):
    """Image files: one named file, or a folder searched recursively (sorted by path; hidden names skipped, and
    files whose extension is no image format skipped and counted)."""

    format = "images"

    def _make_plan(self):
        p = Path(self.path)
        if not p.is_dir():
            if not p.is_file():
                raise AttnkitError(f"image file {self.path!r} does not exist")
            why = image_problem(self.path)
            if why:
                raise AttnkitError(f"{self.path}: {why}")
            return {"files": [self.path], "n_skipped": 0, "unreadable": []}
        known = image_extensions()
        files, skipped = [], 0
        for dirpath, dirnames, filenames in os.walk(self.path, onerror=self._unreadable):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for f in filenames:
                if f.startswith("."):
                    continue
                if Path(f).suffix.lower() in known:
                    files.append(os.path.normpath(os.path.join(dirpath, f)))
                else:
                    skipped += 1
        unreadable = [{"path": f, "why": why} for f in sorted(files, key=lambda f: Path(f).parts)
                      if (why := image_problem(f))]
        bad = {u["path"] for u in unreadable}
        files = sorted((f for f in files if f not in bad), key=lambda f: Path(f).parts)
        if not files:
            raise AttnkitError(f"image folder {self.path!r} holds no readable image files"
                               + (f" ({skipped} files of other kinds)" if skipped else "")
                               + (f"; {unreadable[0]['path']}: {unreadable[0]['why']}" if unreadable else ""))
        return {"files": files, "n_skipped": skipped, "unreadable": unreadable}

    def _unreadable(self, exc: OSError):
        raise AttnkitError(f"cannot read image folder {exc.filename or self.path!r}: {exc.strerror or exc}")

    def _read(self, plan):
        for f in plan["files"]:
            yield ImageItem(f, path=f)

    def sha256(self):
        return hash_files(self.plan()["files"])

    def settings(self):
        return {"format": self.format, "n_files": len(self.plan()["files"])}

    def describe(self):
        plan = self.plan()
        return {**super().describe(), "n_skipped": plan["n_skipped"], "unreadable": plan["unreadable"]}

    def _how(self):
        plan = self.plan()
        out = f"{len(plan['files'])} images"
        if plan["n_skipped"]:
            out += f"; {plan['n_skipped']} files of other kinds skipped"
        if plan["unreadable"]:
            first = plan["unreadable"][0]
            out += (f"; {len(plan['unreadable'])} unreadable images skipped ({first['path']}: {first['why']}"
                    + (", ..." if len(plan["unreadable"]) > 1 else "") + ")")
        return out


class DatasetImagesSource(ImageSource):
    """A column of images (datasets.Image) of a `datasets` directory (save_to_disk), given as DIR:COLUMN; a
    sample's name is DIR[row N]."""

    format = "image dataset"

    def __init__(self, path: str, column: str):
        super().__init__(path)
        self.column = column

    def _make_plan(self):
        return {"n_rows": len(_load_dataset_column(self.path, self.column)), "column": self.column}

    @property
    def reading_path(self) -> str:
        return f"{Path(self.path).resolve()}:{self.column}"

    def _read(self, plan):
        for row in range(plan["n_rows"]):
            yield ImageItem(f"{self.path}[row {row}]", dataset=self.path, column=self.column, row=row)

    def sha256(self):
        from .sources import DatasetSource

        return DatasetSource(self.path).sha256()

    def _how(self):
        return f"{self.plan()['n_rows']} images from column {self.column}"


class EmbeddedImagesSource(ImageSource):
    """The embedded image set (scikit-image's sample images, EMBEDDED_IMAGES)."""

    format = "embedded images"

    def __init__(self):
        super().__init__(EMBEDDED)

    @property
    def reading_path(self) -> str:
        return EMBEDDED

    def _make_plan(self):
        embedded_array(EMBEDDED_IMAGES[0])  # refused now when scikit-image is missing
        return {"images": list(EMBEDDED_IMAGES)}

    def _read(self, plan):
        for name in plan["images"]:
            yield ImageItem(f"{EMBEDDED}:{name}", embedded=name)

    def sha256(self):
        h = hashlib.sha256()
        for name in self.plan()["images"]:
            a = embedded_array(name)
            h.update(f"{name}\0{a.shape}\0{a.dtype}\n".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def file_state(self):
        return {"size": None, "mtime": None}

    def _how(self):
        return f"the embedded image set ({len(EMBEDDED_IMAGES)} scikit-image sample images)"


def image_sources(inputs) -> list[Source]:
    """One Source per input: "embedded" (EMBEDDED_IMAGES), an image file, a folder, a glob, or DIR:COLUMN (a column
    of images of a `datasets` directory). None or [] is the embedded set."""
    from .inputs import expand_glob

    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    out = []
    for given in list(inputs or []) or [EMBEDDED]:
        p = str(given)
        if p == EMBEDDED and not os.path.exists(p):
            out.append(EmbeddedImagesSource())
        elif os.path.exists(p) and not is_datasets_dir(p):
            out.append(ImageFilesSource(p))
        elif ":" in p and is_datasets_dir(p.rsplit(":", 1)[0]):
            path, column = p.rsplit(":", 1)
            out.append(DatasetImagesSource(path, column))
        elif is_datasets_dir(p):
            raise AttnkitError(f"{p!r} is a datasets directory: name its image column, as {p}:COLUMN")
        elif set("*?[") & set(p):
            matches = sorted(expand_glob(p), key=lambda m: Path(m).parts)
            if not matches:
                raise AttnkitError(f"image pattern {p!r} matches no file")
            out.extend(ImageFilesSource(m) for m in matches)
        else:
            raise AttnkitError(f"image input {p!r} does not exist (give image files, folders, DATASET_DIR:COLUMN or "
                               f"{EMBEDDED!r})")
    seen = {}
    for s in out:
        key = os.path.realpath(s.path) + (f":{s.column}" if isinstance(s, DatasetImagesSource) else "")
        if key in seen:
            raise AttnkitError(f"image input {s.path!r} is given twice")
        seen[key] = s
    return out


def is_image_corpus(corpus) -> bool:
    """Whether a `Corpus` reads images (its sources are this module's)."""
    return any(isinstance(s, ImageSource) for s in getattr(corpus, "sources", ()))


__all__ = ["EMBEDDED", "EMBEDDED_IMAGES", "IMAGE_CHARS", "MAX_IMAGE_PIXELS", "DatasetImagesSource", "absolute_item",
           "EmbeddedImagesSource", "ImageFilesSource", "ImageItem", "ImageSource", "decode_image", "embedded_array",
           "image_extensions", "image_problem", "image_sources", "images_of_run", "is_image_corpus", "is_image_run",
           "open_images"]


def open_images(inputs=None, limit: int | None = None):
    """A `Corpus` (attnkit/corpus/inputs.py) of the images of `inputs` (`image_sources`), at most `limit` of them:
    streamed, described and fingerprinted as a text corpus is; nothing is decoded until a batch is built."""
    from ..errors import check_int
    from .inputs import Corpus

    if limit is not None:
        check_int(limit, "limit")
    return Corpus(image_sources(inputs), limit)


def is_image_run(meta) -> bool:
    """Whether a run's meta.json records an image run (`attnkit extract --images`)."""
    reading = ((meta or {}).get("settings") or {}).get("reading") if isinstance(meta, dict) else None
    return isinstance(reading, dict) and bool(reading.get("images"))


def images_of_run(run, meta: dict, limit: int | None = None):
    """The images an image run measured (a `Corpus`, at most `limit`), read from meta.json's inputs as the run read
    them and checked to be the same bytes (their SHA-256): the report's [CLS] maps are of the run's own images."""
    reading = meta["settings"]["reading"]
    corpus = open_images(reading.get("paths") or None, limit=limit)
    recorded = meta.get("inputs")
    if isinstance(recorded, list) and len(recorded) == len(corpus.sources):
        for source, rec in zip(corpus.sources, recorded):
            want = rec.get("sha256") if isinstance(rec, dict) else None
            if want and source.sha256() != want:
                raise AttnkitError(f"{source.name} changed since {run} was measured (its SHA-256 differs from "
                                   "meta.json's)")
    return corpus
