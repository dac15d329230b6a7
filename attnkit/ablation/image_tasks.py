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

from ..models import instrument, runtime_of
from ..tokens import ImageEncoder, image_forward_arguments
from . import metrics
from .data import subset
from .image_data import LabelledImages, label_ids, read_labelled_images
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

    def __init__(self, path: str):
        self.path = path
        data = read_labelled_images(path)
        self.source = data.source
        self.examples = list(zip(data.items, data.labels))

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
                out.append((idx, encoder([self.examples[j][0] for j in idx]),
                            torch.from_numpy(gold[i:i + batch_size])))
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


__all__ = ["ImageClassificationTask", "image_logits"]
