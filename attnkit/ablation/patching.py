"""Activation patching, head by head (`attnkit ablate … --experiment patching`; docs/interventions.md, "Patching
experiments").

Each example is a clean input and a corrupted one of the same token length. A metric reads the model's output on
an input: `cosine` (an embedding model, task stsb: the cosine between the input's mean-pooled embedding and the
example's `reference` text), or `logit_diff` (a masked LM, task mlm: the logit of the `target` token minus that of
the `foil` token at the input's one mask token; a causal LM, task lm: the same for the token predicted after the
input's last token; a classifier, task glue: the logit of the `target` label minus the `foil` label's). For every
head, the corrupted input runs with that head's output replaced by its output on the clean input, at every
position (mode patch, from a `HeadCache` of the clean forward). The head restores

    restored = 100 · (mean patched metric − mean corrupted metric) / (mean clean metric − mean corrupted metric)

percent of the clean-vs-corrupted gap (means over the examples; 0 without a patch, 100 for a full recovery). The
paired bootstrap resamples examples and recomputes this ratio on each resample.

Data: a TSV or CSV file with a header: `clean`, `corrupted`, and `reference` (stsb) or `target` and `foil` (mlm,
glue, lm); glue inputs that are text pairs add `clean_pair` and `corrupted_pair`.
"""
from __future__ import annotations

import numpy as np
import torch

from ..caching import HeadCache, cache_heads, encoder_layers
from ..errors import AttnkitError
from ..interventions import Intervention, only
from ..models import instrument
from ..tokens import Encoder
from . import metrics
from .data import read_patching, subset
from .tasks import Plan, Step, Task, base_hidden, forward, mean_pool

MODEL_TASKS = {"stsb": None, "mlm": "masked-lm", "glue": "sequence-classification", "lm": "causal-lm"}


class PatchingTask(Task):
    """Clean/corrupted pairs read from `path` for a model of kind `kind` (stsb, mlm, glue), scored by `metric`."""

    name = "patching"
    main_metric = "restored"

    def __init__(self, path: str, kind: str, metric: str | None = None):
        self.kind = kind
        self.metric, self.examples = read_patching(path, kind, metric)
        self.model_task = MODEL_TASKS[kind]
        self.path = path
        self.cache: HeadCache | None = None

    def head_cache(self, model) -> HeadCache:
        """The cache that each step's clean forward fills and the patch settings read (one for the task)."""
        if self.cache is None or self.cache.n_layers != len(encoder_layers(model)):
            self.cache = HeadCache(len(encoder_layers(model)))
        return self.cache

    def settings_for(self, model) -> list:
        """(name, intervention, table columns): the unpatched corrupted run, then every head patched alone."""
        iv = Intervention.for_model(model)
        cache = self.head_cache(model)
        out = [("corrupted", iv, {"layer": None, "head": None})]
        for layer in range(iv.shape[0]):
            for head in range(iv.shape[1]):
                out.append((f"L{layer}H{head} patch", Intervention.for_model(model).set(
                    layer, head, mode="patch", value=cache), {"layer": layer, "head": head}))
        return out

    def _segment(self, ex: dict, which: str):
        return (ex[which], ex[f"{which}_pair"]) if f"{which}_pair" in ex else ex[which]

    def segments(self, limit=None) -> list:
        return [self._segment(self.examples[i], "corrupted") for i in subset(len(self.examples), limit)]

    def _token(self, tokenizer, text: str, ex: dict, what: str) -> int:
        if self.kind == "glue":
            return self._label(text, ex, what)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise AttnkitError(f"{self.path}:{ex['line']}: the {what} {text!r} is {len(ids)} tokens; the logit "
                               "difference needs one token each")
        return ids[0]

    def _label(self, text: str, ex: dict, what: str) -> int:
        names = {str(k).lower(): int(v) for k, v in (getattr(self._config, "label2id", None) or {}).items()}
        key = text.strip().lower()
        if key in names:
            return names[key]
        if key.isdigit() and int(key) < self._config.num_labels:
            return int(key)
        raise AttnkitError(f"{self.path}:{ex['line']}: the {what} label {text!r} is neither a label name of the "
                           f"model ({', '.join(names) or 'none'}) nor an output index below {self._config.num_labels}")

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        instrument(model)
        self._config = model.config
        idx = subset(len(self.examples), limit)
        ex = [self.examples[i] for i in idx]
        enc = Encoder(tokenizer, max_length=self.max_length, split_sentences=True)

        clean_n, corrupt_n = (self.token_lengths(tokenizer, [self._segment(e, which) for e in ex])
                              for which in ("clean", "corrupted"))
        for e, a, b in zip(ex, clean_n, corrupt_n):
            if a != b:
                raise AttnkitError(f"{self.path}:{e['line']}: the clean input has {a} tokens and the corrupted one "
                                   f"{b}: patching needs inputs of equal token length")
        order = np.argsort(corrupt_n, kind="stable")
        steps = []
        for i in range(0, len(order), batch_size):
            chunk = order[i:i + batch_size]
            rows = [ex[j] for j in chunk]
            info = {"order": chunk, "clean": enc([self._segment(e, "clean") for e in rows])}
            corrupted = enc([self._segment(e, "corrupted") for e in rows])
            if self.kind == "stsb":
                info["reference"] = enc([e["reference"] for e in rows])
            else:
                info["target"] = torch.tensor([self._token(tokenizer, e["target"], e, "target") for e in rows])
                info["foil"] = torch.tensor([self._token(tokenizer, e["foil"], e, "foil") for e in rows])
            if self.kind == "mlm":
                info["position"] = self._mask_positions(tokenizer, rows, info["clean"], corrupted)
            steps.append(Step(corrupted, info))
        return Plan(steps, idx)

    def _mask_positions(self, tokenizer, rows, clean, corrupted) -> torch.Tensor:
        mask_id = tokenizer.mask_token_id
        if mask_id is None:
            raise AttnkitError("the tokenizer has no mask token: the logit difference of task mlm reads a mask")
        out = []
        for b, e in enumerate(rows):
            where = [torch.nonzero(x.inputs["input_ids"][b] == mask_id).flatten().tolist() for x in (clean, corrupted)]
            if len(where[0]) != 1 or where[0] != where[1]:
                raise AttnkitError(f"{self.path}:{e['line']}: the clean and corrupted inputs need one mask token "
                                   f"({tokenizer.mask_token}) each, at the same position")
            out.append(where[0][0])
        return torch.tensor(out)

    def prepare(self, model, step) -> None:
        """The clean forward (filling the cache the patches read) and the unpatched metrics, without any
        intervention."""
        info = step.info
        with only(model, Intervention.for_model(model)):
            if self.kind == "stsb":
                ref = info["reference"]
                hidden = base_hidden(model, ref)
                info["reference_embedding"] = mean_pool(hidden, ref.inputs["attention_mask"].to(hidden.device)).float()
            with cache_heads(model, cache=self.head_cache(model)):
                info["clean_metric"] = self._metric(info, step.batch, self.outputs(model, info["clean"]))
            info["corrupted_metric"] = self._metric(info, step.batch, self.outputs(model, step.batch))

    def outputs(self, model, batch):
        if self.kind == "stsb":
            return base_hidden(model, batch)
        logits = forward(model, batch).logits
        if self.kind == "lm":  # the prediction of the token after the input: the logits at its last token
            return logits[torch.arange(logits.shape[0], device=logits.device), batch.lengths.to(logits.device) - 1]
        return logits

    def _metric(self, info: dict, batch, outputs) -> np.ndarray:
        out = outputs.float()
        if self.kind == "stsb":
            emb = mean_pool(out, batch.inputs["attention_mask"].to(out.device))
            ref = info["reference_embedding"].to(out.device)
            return torch.nn.functional.cosine_similarity(emb, ref, dim=-1).cpu().numpy().astype(np.float64)
        if self.kind == "mlm":
            out = out[torch.arange(out.shape[0]), info["position"].to(out.device)]
        rows = torch.arange(out.shape[0])
        diff = out[rows, info["target"].to(out.device)] - out[rows, info["foil"].to(out.device)]
        return diff.cpu().numpy().astype(np.float64)

    def reduce(self, step, outputs) -> np.ndarray:
        return self._metric(step.info, step.batch, outputs)

    def summarize(self, plan, parts) -> dict:
        idx = plan.info
        values = {k: np.zeros(len(idx)) for k in ("patched", "clean", "corrupted")}
        for step, part in zip(plan.steps, parts):
            o = step.info["order"]
            values["patched"][o] = part
            values["clean"][o] = step.info["clean_metric"]
            values["corrupted"][o] = step.info["corrupted_metric"]
        mean = {k: float(v.mean()) for k, v in values.items()}
        gap = mean["clean"] - mean["corrupted"]
        if not abs(gap) > 1e-9 * max(1.0, abs(mean["clean"])):
            raise AttnkitError(f"{self.path}: the clean and corrupted inputs give the same mean {self.metric} "
                               f"({mean['clean']:.6g}): there is no gap for patching to restore")
        self.last_examples = metrics.ExampleScores(values, restored_share, np.asarray(idx))
        return {"restored": self.last_examples.value(), self.metric: mean["patched"],
                "clean": mean["clean"], "corrupted": mean["corrupted"], "n": len(idx)}


def restored_share(arrays: dict, weights: np.ndarray) -> np.ndarray:
    """100 · (mean patched − mean corrupted) / (mean clean − mean corrupted) of each resample (rows of counts)."""
    patched, clean, corrupted = (metrics.weighted_mean(arrays[k], weights) for k in ("patched", "clean", "corrupted"))
    with np.errstate(invalid="ignore", divide="ignore"):
        return 100.0 * (patched - corrupted) / (clean - corrupted)


__all__ = ["PatchingTask", "restored_share"]
