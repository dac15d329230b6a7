"""The ablation task of an image classifier (`attnkit ablate --task image-classification`, docs/interventions.md,
"Image classification"): labelled images (attnkit/ablation/image_data.py) through the model's own image processor
(`attnkit.tokens.ImageEncoder`, as `attnkit extract --images` reads them), scored by the accuracy of the arg-max
class (the main metric, ×100) and the mean cross-entropy of the gold class (`loss`, nats). The bootstrap resamples
images; `losses` gives each image's cross-entropy for Michel et al.'s gate gradients.

It evaluates in the four steps of every task (attnkit/ablation/tasks.py), so the sweeps run its settings as they
run a text task's.
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention.positions import ImageTokens, region_ids
from ..errors import AttnkitError
from ..models import instrument, runtime_of
from ..tokens import ImageEncoder, image_forward_arguments
from . import metrics
from .data import subset
from .image_data import (
    DEFAULT_TEMPLATE,
    LabelledImages,
    check_two_towers,
    label_ids,
    read_labelled_images,
    read_regions,
    zero_shot_classes,
)
from .tasks import Plan, Step, Task, forward


def _config_labels(model) -> dict:
    """What `label_ids` reads of a loaded model's config (as config.json holds it)."""
    cfg = model.config
    return {"label2id": getattr(cfg, "label2id", None), "id2label": getattr(cfg, "id2label", None),
            "num_labels": getattr(cfg, "num_labels", None)}


def image_logits(model, batch):
    """The class logits of an instrumented image classifier on a `Batch` of images."""
    return forward(model, batch, **image_forward_arguments(model, batch.inputs)).logits


class ImageClassificationTask(Task):
    """Accuracy and cross-entropy of an image classifier on labelled images (module docstring)."""

    name = "image-classification"
    model_task = "image-classification"
    main_metric = "accuracy"
    max_length = None  # no tokens to cut: every image becomes the model's patches

    def __init__(self, path: str, regions=None):
        self.path = path
        data = read_labelled_images(path)
        self.source = data.source
        self.examples = list(zip(data.items, data.labels))
        self.regions = read_regions(regions)  # the patches' regions for no_intra / no_inter (None: one per image)

    def fit_to(self, model) -> None:
        """Images have no token limit: every image becomes the model's patches."""
        return None

    def segments(self, limit=None) -> list:
        return [self.examples[i][0] for i in subset(len(self.examples), limit)]

    def _labelled(self, chosen: list[int]) -> LabelledImages:
        return LabelledImages([self.examples[i][0] for i in chosen], [self.examples[i][1] for i in chosen],
                              self.source)

    def check_labels(self, config: dict | None, model: str) -> None:
        """Refuse, from the model's config.json before it loads, a label that is no class of the model's."""
        label_ids(self._labelled(list(range(len(self.examples)))), config, model)

    def targets(self, model, chosen: list[int]) -> np.ndarray:
        """The model's class index of the images `chosen` (unknown labels refused by name)."""
        return np.asarray(label_ids(self._labelled(chosen), _config_labels(model),
                                    getattr(model, "name_or_path", "the model")), dtype=np.int64)

    def _batches(self, model, processor, chosen: list[int], batch_size: int) -> list:
        """(image indices, Batch, their classes) per batch of the images `chosen`, in their order (every image has
        the same tokens, so there is no padding to save by sorting); decoded once per processor."""
        key = ("images", id(processor), tuple(chosen), batch_size)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            encoder = ImageEncoder(processor, runtime_of(model).image)
            gold = self.targets(model, chosen)
            out = []
            for i in range(0, len(chosen), batch_size):
                idx = chosen[i:i + batch_size]
                batch = encoder([self.examples[j][0] for j in idx])
                if self.regions is not None:  # as interventions.patch_regions gives them
                    tokens = ImageTokens(runtime_of(model).image, tuple(batch.inputs["pixel_values"].shape[-2:]))
                    batch.sentence_id = region_ids(tokens, self.regions, len(idx))
                out.append((idx, batch, torch.from_numpy(gold[i:i + batch_size])))
            cache[key] = out
        return cache[key]

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        instrument(model)
        chosen = subset(len(self.examples), limit)
        steps = [Step(batch, (idx, gold)) for idx, batch, gold in self._batches(model, tokenizer, chosen, batch_size)]
        return Plan(steps, chosen)

    def outputs(self, model, batch):
        return image_logits(model, batch)

    def reduce(self, step, logits):
        """Per image of the step: (image, predicted class, cross-entropy of its gold class in nats)."""
        idx, gold = step.info
        logits = logits.float().cpu()
        nll = torch.nn.functional.cross_entropy(logits, gold, reduction="none").double()
        return [(j, int(p), float(n)) for j, p, n in zip(idx, logits.argmax(-1).tolist(), nll.tolist())]

    def summarize(self, plan, parts) -> dict:
        per_image = {j: (p, n) for part in parts for j, p, n in part}
        chosen = plan.info
        pred = np.array([per_image[j][0] for j in chosen], dtype=np.int64)
        nll = np.array([per_image[j][1] for j in chosen], dtype=np.float64)
        gold = np.concatenate([s.info[1].numpy() for s in plan.steps])
        self.last_examples = metrics.ExampleScores(
            {"pred": pred, "gold": gold, "nll": nll},
            lambda a, w: metrics.weighted_accuracy(a["pred"], a["gold"], w), np.asarray(chosen))
        return {"accuracy": metrics.accuracy(pred, gold), "loss": float(nll.mean()), "n": len(chosen)}

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        chosen = subset(len(self.examples), limit)
        for _, batch, gold in self._batches(model, tokenizer, chosen, batch_size):
            logits = image_logits(model, batch).float()
            yield torch.nn.functional.cross_entropy(logits, gold.to(logits.device))




# --- zero-shot classification with an image–text model (CLIP, SigLIP) ------------------------------------------

class ZeroShotImageTask(ImageClassificationTask):
    """Zero-shot classification by a two-tower image–text model (CLIPModel, SiglipModel): each class is a prompt
    (`template` filled with the class name; `labels`: the classes, default the data's labels, sorted), an image's
    class logits are the model's own image–text logits (logit_scale · cosine, plus SigLIP's logit_bias), and the
    metrics are those of `ImageClassificationTask` over them. The ablated model is the vision tower
    (`model.vision_model`, instrumented alone); the prompts' embeddings come from the text tower once, as it is, so
    no intervention reaches the text tower's heads."""

    name = "zero-shot-image"
    model_task = None

    def __init__(self, path: str, labels: list[str] | None = None, template: str = DEFAULT_TEMPLATE, regions=None):
        super().__init__(path, regions)
        self.classes, self.prompts = zero_shot_classes(self._labelled(list(range(len(self.examples)))), labels,
                                                       template)
        self.text = None  # the prompts' normalised embeddings, set by `load`

    def check_labels(self, config: dict | None, model: str) -> None:
        """The labels are the prompts' classes (checked when the task is made); the model needs two towers."""
        check_two_towers(config, model)

    def load(self, path: str, device=None):
        """The image–text model at `path` (transformers' AutoModel), its vision tower instrumented, and the prompts'
        embeddings from its text tower: returns (the vision tower, the image processor), what the ablation runs."""
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        from ..models import resolve_device

        dev = resolve_device(device)
        try:
            model = AutoModel.from_pretrained(path).to(dev).eval()
            tokenizer = AutoTokenizer.from_pretrained(path)
            processor = AutoImageProcessor.from_pretrained(path)
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise AttnkitError(f"could not load an image–text model from {path!r}: {why}") from None
        enc = tokenizer(self.prompts, **prompt_padding(model.config), truncation=True, return_tensors="pt").to(dev)
        with torch.no_grad():
            text = _features(model.get_text_features(**enc))
            self.scale = float(model.logit_scale.exp())
            self.bias = float(model.logit_bias) if getattr(model, "logit_bias", None) is not None else 0.0
        self.text = torch.nn.functional.normalize(text.float(), dim=-1)
        self.projection = getattr(model, "visual_projection", None)
        return instrument(model.vision_model), processor

    def targets(self, model, chosen: list[int]) -> np.ndarray:
        return np.asarray([self.classes.index(str(self.examples[i][1])) for i in chosen], dtype=np.int64)

    def outputs(self, model, batch):
        pooled = forward(model, batch, **image_forward_arguments(model, batch.inputs)).pooler_output
        image = pooled if self.projection is None else self.projection(pooled)
        image = torch.nn.functional.normalize(image.float(), dim=-1)
        return image @ self.text.to(image.device).T * self.scale + self.bias

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        chosen = subset(len(self.examples), limit)
        for _, batch, gold in self._batches(model, tokenizer, chosen, batch_size):
            logits = self.outputs(model, batch)
            yield torch.nn.functional.cross_entropy(logits, gold.to(logits.device))


def prompt_padding(config) -> dict:
    """How the prompts are padded: SigLIP's text tower to its positions (as it was trained: it pools the last token),
    CLIP's to the longest prompt (it pools the end-of-text token)."""
    if config.model_type == "siglip":
        return {"padding": "max_length", "max_length": config.text_config.max_position_embeddings}
    return {"padding": True}


def _features(out) -> torch.Tensor:
    """get_text_features' embeddings (transformers 5 returns them as the pooler_output of a model output)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


__all__ = ["DEFAULT_TEMPLATE", "ImageClassificationTask", "ZeroShotImageTask", "image_logits", "prompt_padding"]
