"""Evaluation tasks for ablations. Every loader reads local files only (no hub access).

    task = get_task("stsb", "dev.tsv")
    task.evaluate(model, tokenizer, limit=500, batch_size=32)   # {"spearman": 82.1, "pearson": ..., "n": 500}
    task.main_metric                                              # "spearman"

Each task also yields differentiable losses (`losses`) for gradient head importance (Michel et al.):
* stsb: MSE between the cosine of the two mean-pooled embeddings and the gold score scaled to [0, 1]
  (sentence-transformers' CosineSimilarityLoss, the loss STS models are fine-tuned with). Per pair, so
  |∂L/∂gate| is taken per example as Michel et al. define it (a correlation is not per-example).
* glue: cross-entropy (MSE on the single logit for STS-B regression models).
* squad: the model's start/end cross-entropy on the first answer (position 0 = no answer / not in window).
* mlm: cross-entropy on the masked tokens (also the task's main metric, `loss`).
* lm: next-token cross-entropy of a causal language model over the corpus tokens (main metric `loss`, nats).
* seq2seq: an encoder–decoder's teacher-forced cross-entropy of each target given its source (main metric `loss`).

Every task evaluates in four steps that the ablation sweeps (attnkit/ablation/sweep.py) also drive one by one:
`plan` (the batches, and what reading their outputs needs), `outputs` (one forward of a batch: tensors whose
first axis is the batch), `reduce` (a batch's outputs → small per-example results on the CPU) and `summarize`
(the metrics of all batches, and `last_examples`: the per-example outputs, for bootstrap intervals and the
per-example file). `prepare` runs what a batch needs before its forwards (nothing, except for patching).

Forwards set the attnkit runtime's batch info (lengths, token classes, sentence ids), so
region interventions (no_intra / no_inter) know the sentences: the two segments of a pair are different
sentences, and segments are also split after "." "!" "?" (Guan et al. constrain attention by sentences).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import AttnkitError, arg, check_int
from ..features import DEFAULT_MAX_LENGTH
from ..models import check_max_length, instrument, max_positions, runtime_of
from ..tokens import Batch, Encoder, pair_decoder_start
from . import metrics, translation
from .data import (
    GLUE,
    check_gold_varies,
    read_glue,
    read_pairs,
    read_squad,
    read_stsb,
    read_text_data,
    subset,
)
from .names import IMAGE_TASKS, SQUAD_MAX_LENGTH, SQUAD_STRIDE, TASKS, task_max_length


def _device(model) -> torch.device:
    return next(model.parameters()).device


def forward(model, batch: Batch, **extra):
    """One forward of an instrumented model on a `Batch` (moved to the model's device)."""
    batch = batch.to(_device(model))
    with runtime_of(model).batch_of(batch):
        return model(**batch.inputs, **extra)


def base_hidden(model, batch: Batch) -> torch.Tensor:
    """The last hidden states (B × L × hidden) of the base model of an instrumented `model` on `batch`."""
    batch = batch.to(_device(model))
    with runtime_of(model).batch_of(batch):
        return getattr(model, "base_model", model)(**batch.inputs)[0]


@dataclass
class Step:
    """One batch of a task's evaluation and what `Task.reduce` needs to read its outputs."""

    batch: Batch
    info: object = None


@dataclass
class Plan:
    """The batches of one evaluation, and what `Task.summarize` needs to score them."""

    steps: list
    info: object = None


class Task:
    """A dataset plus how to score a model on it."""

    name = ""
    main_metric = ""
    model_task: str | None = None  # the `task` argument of attnkit.load_model
    max_length = DEFAULT_MAX_LENGTH
    length_given = False  # whether max_length was asked for; else it is the task's default (`fit_to`)
    last_examples = None  # metrics.ExampleScores of the last evaluate(), for bootstrap intervals
    sweeps = True  # whether sweeps (sweep.py, which resume one stack of layers) evaluate its settings

    path = ""

    def __len__(self) -> int:
        return len(self.examples)

    def head(self, n: int) -> Task:
        """Keep only the first `n` examples of the file (`attnkit ablate --limit`)."""
        check_int(n, "limit")
        self.examples = self.examples[:n]
        self.__dict__.pop("_cache", None)
        return self

    def token_lengths(self, tokenizer, segments) -> list[int]:
        """Tokens of each segment (a text or a pair) as the model sees it, truncated to the task's max_length."""
        return [len(x) for x in tokenizer([s if isinstance(s, str) else list(s) for s in segments], truncation=True,
                                          max_length=self.max_length)["input_ids"]]

    def _encode(self, tokenizer, segments, limit, batch_size, extra=None) -> list[tuple[np.ndarray, Batch]]:
        """Batches of segments sorted by length (less padding); each with the original indices."""
        key = (id(tokenizer), len(segments), hash(tuple(segments)), batch_size)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            enc = Encoder(tokenizer, max_length=self.max_length, split_sentences=True)
            order = np.argsort(self.token_lengths(tokenizer, segments), kind="stable")
            batches = []
            for i in range(0, len(order), batch_size):
                idx = order[i:i + batch_size]
                batches.append((idx, enc([segments[j] for j in idx])))
            cache[key] = batches
        return cache[key]

    def fit_to(self, model) -> int | None:
        """Make max_length fit `model`'s positions (attnkit.run.model_dir.max_positions), so that no input runs past
        them: a length that was asked for (`length_given`) and exceeds them is refused (check_max_length); the
        task's default is cut to them. Returns the default it cut, else None."""
        limit = max_positions(model)
        if limit is None or self.max_length <= limit:
            return None
        if self.length_given:
            check_max_length(model, self.max_length)
        cut, self.max_length = self.max_length, limit
        self.__dict__.pop("_cache", None)  # batches encoded at the old length
        return cut

    def segments(self, limit: int | None = None) -> list:
        """The inputs the model sees in an evaluation under `limit` (texts or text pairs), e.g. for the mean
        outputs of every head over them (`attnkit ablate --mode mean`)."""
        raise NotImplementedError

    def plan(self, model, tokenizer, limit: int | None = None, batch_size: int = 32) -> Plan:
        raise NotImplementedError

    def prepare(self, model, step: Step) -> None:
        """What `step` needs before its forwards (run once per step, however many settings are evaluated)."""

    def outputs(self, model, batch: Batch):
        """One forward of `batch`: a tensor, or a tuple of tensors, whose first axis is the batch's samples."""
        raise NotImplementedError

    def reduce(self, step: Step, outputs):
        """The outputs of `step`'s forward → what `summarize` needs of them (small, on the CPU)."""
        raise NotImplementedError

    def summarize(self, plan: Plan, parts: list) -> dict:
        """The metrics of one evaluation from every step's reduced outputs; sets `last_examples`."""
        raise NotImplementedError

    def evaluate(self, model, tokenizer, limit: int | None = None, batch_size: int = 32) -> dict:
        """The task's metrics of `model` on the examples under `limit` (as `subset` picks them)."""
        self.fit_to(model)
        instrument(model)
        self.last_examples = None
        plan = self.plan(model, tokenizer, limit, batch_size)
        parts = []
        with torch.inference_mode():
            for step in plan.steps:
                self.prepare(model, step)
                parts.append(self.reduce(step, self.outputs(model, step.batch)))
        return self.summarize(plan, parts)

    def losses(self, model, tokenizer, limit: int | None = None, batch_size: int = 1) -> Iterator[torch.Tensor]:
        """Differentiable losses, one per group of `batch_size` examples."""
        raise NotImplementedError


# --- STS-B with a sentence-embedding model ------------------------------------------------------------
def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


class StsbTask(Task):
    """Sentence-embedding similarity: cosine of mean-pooled embeddings vs the gold 0-5 score."""

    name = "stsb"
    main_metric = "spearman"
    model_task = None

    def __init__(self, path: str):
        self.path = path
        self.examples = read_stsb(path)

    def segments(self, limit=None) -> list:
        ex = [self.examples[i] for i in subset(len(self.examples), limit)]
        return list(dict.fromkeys([s for a, b, _ in ex for s in (a, b)]))

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        idx = subset(len(self.examples), limit)
        sentences = self.segments(limit)
        steps = [Step(batch, order) for order, batch in self._encode(tokenizer, sentences, len(sentences), batch_size)]
        return Plan(steps, (idx, {s: i for i, s in enumerate(sentences)}))

    def outputs(self, model, batch):
        return base_hidden(model, batch)

    def reduce(self, step, hidden):
        mask = step.batch.inputs["attention_mask"].to(hidden.device)
        return mean_pool(hidden, mask).float().cpu()

    def summarize(self, plan, parts) -> dict:
        idx, where = plan.info
        emb = torch.empty(len(where), parts[0].shape[1])
        for step, part in zip(plan.steps, parts):
            emb[torch.as_tensor(step.info)] = part
        ex = [self.examples[i] for i in idx]
        a = emb[[where[e[0]] for e in ex]]
        b = emb[[where[e[1]] for e in ex]]
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).numpy().astype(np.float64)
        gold = np.array([e[2] for e in ex])
        check_gold_varies(self.path, gold)
        self.last_examples = metrics.ExampleScores(
            {"pred": cos, "gold": gold}, lambda a, w: metrics.weighted_spearman(a["pred"], a["gold"], w),
            np.asarray(idx))
        return {"spearman": metrics.spearman(cos, gold), "pearson": metrics.pearson(cos, gold), "n": len(ex)}

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        examples = [self.examples[i] for i in subset(len(self.examples), limit)]
        enc = Encoder(tokenizer, max_length=self.max_length, split_sentences=True)
        for i in range(0, len(examples), batch_size):
            ex = examples[i:i + batch_size]
            batch = enc([s for a, b, _ in ex for s in (a, b)]).to(_device(model))
            hidden = base_hidden(model, batch)
            emb = mean_pool(hidden, batch.inputs["attention_mask"]).float()
            cos = torch.nn.functional.cosine_similarity(emb[0::2], emb[1::2], dim=-1)
            gold = torch.tensor([e[2] / 5.0 for e in ex], device=cos.device)
            yield torch.nn.functional.mse_loss(cos, gold)


class GlueTask(Task):
    name = "glue"
    model_task = "sequence-classification"

    def __init__(self, path: str, subtask: str | None = None):
        self.path = path
        self.subtask, self.examples = read_glue(path, subtask)
        self.spec = GLUE[self.subtask]
        self.main_metric = self.spec.main

    def _label_ids(self, model) -> dict:
        """GLUE label name → the model's output index (from config.label2id when it names them)."""
        labels = self.spec.labels
        n_out = model.config.num_labels
        if labels is None:
            if n_out != 1:
                raise AttnkitError(f"STS-B is a regression task but the model has {n_out} outputs (need 1)")
            return {}
        if n_out != len(labels):
            raise AttnkitError(f"GLUE {self.subtask} has {len(labels)} labels but the model has {n_out} outputs")
        l2i = {str(k).lower(): int(v) for k, v in (getattr(model.config, "label2id", None) or {}).items()}
        if all(lab in l2i for lab in labels):
            return {lab: l2i[lab] for lab in labels}
        return {lab: i for i, lab in enumerate(labels)}

    def _targets(self, model, ex) -> np.ndarray:
        ids = self._label_ids(model)
        return np.array([e[1] if not ids else ids[e[1]] for e in ex])

    def score(self, pred: np.ndarray, gold: np.ndarray, positive: int = 1) -> dict:
        out = {}
        if self.spec.labels is None:
            out["pearson"] = metrics.pearson(pred, gold)
            out["spearman"] = metrics.spearman(pred, gold)
            out["pearson_and_spearman"] = (out["pearson"] + out["spearman"]) / 2
            return out
        out["accuracy"] = metrics.accuracy(pred, gold)
        if "f1" in self.spec.metrics:
            out["f1"] = metrics.f1((pred == positive).astype(int), (gold == positive).astype(int))
            out["acc_and_f1"] = (out["accuracy"] + out["f1"]) / 2
        if "mcc" in self.spec.metrics:
            out["mcc"] = metrics.matthews(pred, gold)
        return out

    def resampled_main(self, pred: np.ndarray, gold: np.ndarray, weights: np.ndarray, positive: int = 1) -> np.ndarray:
        """The main metric of each resample (rows of counts), as `score` computes it on the examples."""
        main = self.main_metric
        if main == "pearson_and_spearman":
            return (metrics.weighted_pearson(pred, gold, weights) + metrics.weighted_spearman(pred, gold, weights)) / 2
        if main == "mcc":
            return metrics.weighted_matthews(pred, gold, weights)
        acc = metrics.weighted_accuracy(pred, gold, weights)
        if main == "acc_and_f1":
            return (acc + metrics.weighted_f1(pred, gold, weights, positive)) / 2
        return acc

    def segments(self, limit=None) -> list:
        return [self.examples[i][0] for i in subset(len(self.examples), limit)]

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        idx = subset(len(self.examples), limit)
        ex = [self.examples[i] for i in idx]
        encoded = self._encode(tokenizer, [e[0] for e in ex], len(ex), batch_size)
        steps = [Step(batch, order) for order, batch in encoded]
        positive = self._label_ids(model).get("1", 1) if self.spec.labels is not None else 1
        return Plan(steps, (idx, self._targets(model, ex), positive))

    def outputs(self, model, batch):
        return forward(model, batch).logits

    def reduce(self, step, logits):
        logits = logits.float().cpu()
        return logits[:, 0].numpy().astype(np.float64) if self.spec.labels is None else logits.argmax(-1).numpy()

    def summarize(self, plan, parts) -> dict:
        idx, gold, positive = plan.info
        regression = self.spec.labels is None
        pred = np.zeros(len(idx), dtype=np.float64 if regression else np.int64)
        for step, part in zip(plan.steps, parts):
            pred[step.info] = part
        if regression:
            check_gold_varies(self.path, gold)
        out = self.score(pred, gold, positive)
        out["n"] = len(idx)
        self.last_examples = metrics.ExampleScores(
            {"pred": pred, "gold": gold}, lambda a, w: self.resampled_main(a["pred"], a["gold"], w, positive),
            np.asarray(idx))
        return out

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        examples = [self.examples[i] for i in subset(len(self.examples), limit)]
        enc = Encoder(tokenizer, max_length=self.max_length, split_sentences=True)
        for i in range(0, len(examples), batch_size):
            ex = examples[i:i + batch_size]
            logits = forward(model, enc([e[0] for e in ex])).logits.float()
            y = torch.as_tensor(self._targets(model, ex), device=logits.device)
            if self.spec.labels is None:
                yield torch.nn.functional.mse_loss(logits[:, 0], y.float())
            else:
                yield torch.nn.functional.cross_entropy(logits, y.long())


# --- SQuAD v1.1 / v2.0 with a question-answering model ------------------------------------------------
class SquadTask(Task):
    name = "squad"
    model_task = "question-answering"
    main_metric = "f1"

    def __init__(self, path: str, max_length: int = SQUAD_MAX_LENGTH, stride: int | None = None, n_best: int = 20,
                 max_answer_length: int = 30):
        self.path = path
        # windows overlap by SQUAD_STRIDE tokens, less in shorter windows (at most a third of one)
        self.max_length, self.stride = max_length, min(SQUAD_STRIDE, max_length // 3) if stride is None else stride
        self.n_best, self.max_answer_length = n_best, max_answer_length
        self.examples, self.v2 = read_squad(path)  # (qid, question, context, [answer texts], [answer starts])

    def fit_to(self, model) -> int | None:
        cut = super().fit_to(model)
        if cut is not None:
            self.stride = min(self.stride, self.max_length // 3)
        return cut

    def _features(self, tokenizer, idx: list[int]):
        """Tokenised windows of the questions `idx`: list of dicts, cached per tokenizer."""
        key = ("features", id(tokenizer), tuple(idx))
        cache = self.__dict__.setdefault("_cache", {})
        if key in cache:
            return cache[key]
        ex = [self.examples[i] for i in idx]
        enc = tokenizer([e[1] for e in ex], [e[2] for e in ex], truncation="only_second",
                        max_length=self.max_length, stride=self.stride, return_overflowing_tokens=True,
                        return_offsets_mapping=True, padding=False)
        encoder = Encoder(tokenizer, max_length=self.max_length, split_sentences=True)
        feats = []
        for i, ids in enumerate(enc["input_ids"]):
            seq = enc.sequence_ids(i)
            feats.append({
                "example": idx[enc["overflow_to_sample_mapping"][i]], "input_ids": ids,
                "token_type_ids": enc["token_type_ids"][i] if "token_type_ids" in enc else None,
                "offsets": [o if s == 1 else None for o, s in zip(enc["offset_mapping"][i], seq)],
                "sentence_id": encoder.sentence_ids(ids, seq),
            })
        cache[key] = (feats, encoder)
        return cache[key]

    @staticmethod
    def _collate(feats, encoder, pad_id) -> Batch:
        L = max(len(f["input_ids"]) for f in feats)
        B = len(feats)
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        tt = torch.zeros((B, L), dtype=torch.long)
        sid = torch.zeros((B, L), dtype=torch.int32)
        for b, f in enumerate(feats):
            n = len(f["input_ids"])
            ids[b, :n] = torch.tensor(f["input_ids"])
            mask[b, :n] = 1
            sid[b, :n] = torch.tensor(f["sentence_id"], dtype=torch.int32)
            if f["token_type_ids"] is not None:
                tt[b, :n] = torch.tensor(f["token_type_ids"])
        inputs = {"input_ids": ids, "attention_mask": mask}
        if feats[0]["token_type_ids"] is not None:
            inputs["token_type_ids"] = tt
        return Batch(inputs, mask.sum(-1), torch.from_numpy(encoder.token_classes(ids.numpy())), sid, 0)

    def _best(self, f, start, end) -> tuple[float, str | None, float]:
        """(best span score, its text, null score) for one window."""
        offsets = f["offsets"]
        null = float(start[0] + end[0])
        best, text = -float("inf"), None
        ctx = self.examples[f["example"]][2]
        starts = np.argsort(start)[::-1][: self.n_best]
        ends = np.argsort(end)[::-1][: self.n_best]
        for s in starts:
            if s >= len(offsets) or offsets[s] is None:
                continue
            for e in ends:
                if e >= len(offsets) or offsets[e] is None or e < s or e - s + 1 > self.max_answer_length:
                    continue
                score = float(start[s] + end[e])
                if score > best:
                    best, text = score, ctx[offsets[s][0]:offsets[e][1]]
        return best, text, null

    def segments(self, limit=None) -> list:
        return [(self.examples[i][1], self.examples[i][2]) for i in subset(len(self.examples), limit)]

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        idx = subset(len(self.examples), limit)
        feats, encoder = self._features(tokenizer, idx)
        order = np.argsort([len(f["input_ids"]) for f in feats], kind="stable")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        steps = []
        for i in range(0, len(order), batch_size):
            chunk = [feats[j] for j in order[i:i + batch_size]]
            steps.append(Step(self._collate(chunk, encoder, pad), chunk))
        return Plan(steps, idx)

    def outputs(self, model, batch):
        out = forward(model, batch)
        return out.start_logits, out.end_logits

    def reduce(self, step, outputs):
        """(example, best span score, its text, null score) of every window of the step."""
        s_all, e_all = (t.float().cpu().numpy() for t in outputs)
        found = []
        for b, f in enumerate(step.info):
            L = len(f["input_ids"])
            found.append((f["example"], *self._best(f, s_all[b, :L], e_all[b, :L])))
        return found

    def summarize(self, plan, parts) -> dict:
        idx = plan.info
        best = {}  # example -> (score, text, min null)
        for example, score, text, null in (w for part in parts for w in part):
            prev = best.get(example, (-float("inf"), None, float("inf")))
            if score > prev[0]:
                prev = (score, text, prev[2])
            best[example] = (prev[0], prev[1], min(prev[2], null))
        preds, golds = {}, {}
        for k in idx:
            qid, _, _, answers, _ = self.examples[k]
            score, text, null = best.get(k, (-float("inf"), None, 0.0))
            if text is None or (self.v2 and null > score):
                text = ""
            preds[qid] = text
            golds[qid] = answers
        out = metrics.squad_scores(preds, golds)
        out["n"] = len(idx)
        qids, em, f1s = metrics.squad_per_question(preds, golds)
        self.last_examples = metrics.ExampleScores(
            {"exact": em, "f1": f1s, "prediction": np.array([preds[q] for q in qids], dtype=object),
             "id": np.array(qids, dtype=object)},
            lambda a, w: 100.0 * metrics.weighted_mean(a[self.main_metric], w), np.asarray(idx))
        return out

    def answer_positions(self, f) -> tuple[int, int]:
        """Token positions of the first gold answer in window `f`; (0, 0) when there is none in it."""
        _, _, _, texts, chars = self.examples[f["example"]]
        if not texts:
            return 0, 0
        a0, a1 = chars[0], chars[0] + len(texts[0])
        offs = f["offsets"]
        cand = [t for t, o in enumerate(offs) if o is not None]
        s_c = [t for t in cand if offs[t][0] <= a0 < max(offs[t][1], offs[t][0] + 1)]
        e_c = [t for t in cand if offs[t][0] < a1 <= offs[t][1]]
        if s_c and e_c and e_c[0] >= s_c[0]:
            return s_c[0], e_c[0]
        return 0, 0

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        feats, encoder = self._features(tokenizer, subset(len(self.examples), limit))
        first = {}
        for f in feats:  # the first window of each question
            first.setdefault(f["example"], f)
        items = [first[k] for k in sorted(first)]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        for i in range(0, len(items), batch_size):
            chunk = items[i:i + batch_size]
            starts, ends = zip(*(self.answer_positions(f) for f in chunk))
            dev = _device(model)
            out = forward(model, self._collate(chunk, encoder, pad),
                          start_positions=torch.tensor(starts, device=dev),
                          end_positions=torch.tensor(ends, device=dev))
            yield out.loss


# --- masked-language modelling on any corpus ----------------------------------------------------------
def token_mean_loss(count: str):
    """The metric of a language-model loss task on resamples: Σ nll / Σ tokens over the resampled texts (the mean
    cross-entropy per token, in nats; each text weighs by its tokens, as in the loss of the whole corpus)."""
    def loss(arrays: dict, weights: np.ndarray) -> np.ndarray:
        return (weights @ arrays["nll"]) / np.maximum(weights @ arrays[count], 1)

    return loss


class MlmTask(Task):
    """Masked-LM loss: 15% of the non-special tokens of each text (at least one) are replaced by the mask token,
    chosen with a generator seeded by (seed, text index), so the masks do not depend on --limit or the batch size.
    The main metric is the mean cross-entropy (nats) over the masked tokens of the corpus; the accuracy of the
    arg-max prediction is reported beside it."""

    name = "mlm"
    model_task = "masked-lm"
    main_metric = "loss"

    def __init__(self, path: str, mask_prob: float = 0.15, seed: int = 0):
        self.path = path
        self.examples = read_text_data(path)
        if not 0 < mask_prob < 1:
            raise AttnkitError(f"mask probability must be in (0, 1), got {mask_prob}")
        self.mask_prob, self.seed = mask_prob, seed

    def _masked(self, tokenizer, limit: int | None, batch_size: int):
        key = ("masked", id(tokenizer), limit, batch_size)
        cache = self.__dict__.setdefault("_cache", {})
        if key in cache:
            return cache[key]
        if tokenizer.mask_token_id is None:
            raise AttnkitError("the tokenizer has no mask token: the mlm task needs a masked-LM tokenizer")
        special = set(tokenizer.all_special_ids)
        out = []
        chosen = subset(len(self.examples), limit)
        for idx, batch in self._encode(tokenizer, [self.examples[i] for i in chosen], limit, batch_size):
            ids = batch.inputs["input_ids"].clone()
            labels = torch.full_like(ids, -100)
            for b, j in enumerate(idx):
                L = int(batch.lengths[b])
                cand = [t for t in range(L) if int(ids[b, t]) not in special]
                if not cand:
                    continue
                rng = np.random.default_rng([self.seed, chosen[int(j)]])
                k = max(1, int(round(self.mask_prob * len(cand))))
                pick = rng.choice(cand, size=k, replace=False)
                labels[b, pick] = ids[b, pick]
                ids[b, pick] = tokenizer.mask_token_id
            inputs = dict(batch.inputs, input_ids=ids)
            orig = [chosen[int(j)] for j in idx]
            out.append((orig, Batch(inputs, batch.lengths, batch.token_class, batch.sentence_id, 0), labels))
        cache[key] = out
        return out

    def segments(self, limit=None) -> list:
        return [self.examples[i] for i in subset(len(self.examples), limit)]

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        steps = [Step(batch, (orig, labels)) for orig, batch, labels in self._masked(tokenizer, limit, batch_size)]
        return Plan(steps, len(subset(len(self.examples), limit)))

    def outputs(self, model, batch):
        return forward(model, batch).logits

    def reduce(self, step, logits):
        """Per example of the step: (text, masked tokens predicted right, masked tokens, their summed
        cross-entropy in nats)."""
        orig, labels = step.info
        logits = logits.float().cpu()
        sel = labels != -100
        hit = (logits.argmax(-1) == labels) & sel
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none",
                                                ignore_index=-100).double()  # B×L, 0 where nothing is masked
        return [(j, int(hit[b].sum()), int(sel[b].sum()), float(nll[b].sum())) for b, j in enumerate(orig)]

    def summarize(self, plan, parts) -> dict:
        per_example = {j: (c, m, nll) for part in parts for j, c, m, nll in part}
        keys = sorted(per_example)
        correct, masked, nll = (np.array([per_example[k][i] for k in keys]) for i in range(3))
        total = int(masked.sum())
        if total == 0:
            raise AttnkitError("no token could be masked in the corpus")
        self.last_examples = metrics.ExampleScores(
            {"correct": correct, "masked": masked, "nll": nll}, token_mean_loss("masked"), np.asarray(keys))
        return {"loss": float(nll.sum()) / total, "accuracy": 100.0 * int(correct.sum()) / total, "n": plan.info,
                "masked": total}

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        for _, batch, labels in self._masked(tokenizer, limit, batch_size):
            if (labels != -100).any():
                logits = forward(model, batch).logits.float()
                keep = labels != -100
                yield torch.nn.functional.cross_entropy(logits[keep], labels[keep].to(logits.device))


# --- next-token prediction with a causal language model -----------------------------------------------
def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """B × (L − 1) cross-entropy (nats, fp32) of predicting token t + 1 from the logits at t, 0 where t + 1 is
    padding (`lengths`: the valid tokens of each sample, right padding)."""
    L = input_ids.shape[1]
    target = input_ids[:, 1:].to(logits.device)
    keep = torch.arange(1, L, device=logits.device)[None, :] < lengths.to(logits.device)[:, None]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), target, reduction="none")
    return torch.where(keep, nll, torch.zeros_like(nll))


def summarize_token_loss(task: Task, plan, parts, nothing_to_predict: str) -> dict:
    """The token-mean loss of a task whose steps reduce to (example, predicted tokens, their summed cross-entropy):
    {"loss", "perplexity", "n", "tokens"}, with the per-example scores kept on `task.last_examples` for the
    bootstrap. `nothing_to_predict` says why no example has a token (refused by name)."""
    per_example = {j: (n, nll) for part in parts for j, n, nll in part}
    keys = sorted(per_example)
    tokens, nll = (np.array([per_example[k][i] for k in keys]) for i in range(2))
    total = int(tokens.sum())
    if total == 0:
        raise AttnkitError(f"{task.path}: {nothing_to_predict}")
    task.last_examples = metrics.ExampleScores({"tokens": tokens, "nll": nll}, token_mean_loss("tokens"),
                                               np.asarray(keys))
    loss = float(nll.sum()) / total
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "n": plan.info, "tokens": total}


class LmTask(Task):
    """Language-model loss of a causal (decoder) model: the mean next-token cross-entropy, in nats, over the
    corpus tokens. Each text is tokenised as the model's tokenizer does (its BOS where it adds one), truncated to
    max_length, and every token after the first is predicted from those before it (the loss transformers computes
    with labels = input_ids); a text of n tokens contributes n − 1 predictions. The loss of the corpus is
    Σ nll / Σ predictions, so a text weighs by its tokens; the bootstrap resamples texts (segments)."""

    name = "lm"
    model_task = "causal-lm"
    main_metric = "loss"

    def __init__(self, path: str):
        self.path = path
        self.examples = read_text_data(path)

    def segments(self, limit=None) -> list:
        return [self.examples[i] for i in subset(len(self.examples), limit)]

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        chosen = subset(len(self.examples), limit)
        texts = [self.examples[i] for i in chosen]
        steps = [Step(batch, [chosen[int(j)] for j in idx]) for idx, batch in
                 self._encode(tokenizer, texts, limit, batch_size)]
        return Plan(steps, len(chosen))

    def outputs(self, model, batch):
        logits = forward(model, batch).logits
        return next_token_nll(logits, batch.inputs["input_ids"], batch.lengths)

    def reduce(self, step, nll):
        """Per text of the step: (text, predicted tokens, their summed cross-entropy)."""
        nll = nll.double().cpu()
        n = (step.batch.lengths - 1).clamp(min=0)
        return [(j, int(n[b]), float(nll[b].sum())) for b, j in enumerate(step.info)]

    def summarize(self, plan, parts) -> dict:
        return summarize_token_loss(self, plan, parts, "every text is one token long: there is no next token to "
                                                       "predict")

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        chosen = subset(len(self.examples), limit)
        enc = Encoder(tokenizer, max_length=self.max_length, split_sentences=True)
        for i in range(0, len(chosen), batch_size):
            batch = enc([self.examples[j] for j in chosen[i:i + batch_size]]).to(_device(model))
            if int(batch.lengths.max()) < 2:
                continue
            nll = next_token_nll(forward(model, batch).logits, batch.inputs["input_ids"], batch.lengths)
            yield nll.sum() / (batch.lengths - 1).clamp(min=0).sum()


# --- an encoder–decoder's target given its source ------------------------------------------------------------
class Seq2seqTask(Task):
    """Teacher-forced loss of an encoder–decoder (docs/seq2seq.md): each (source, target) pair is encoded as
    `attnkit extract` measures it (`Encoder(decoder_start=...)`: the decoder reads the target shifted right), and
    every target token is predicted from the source and the target before it — the loss transformers computes with
    `labels` = the target's tokens. The main metric is Σ nll / Σ target tokens over the pairs (nats per token); the
    bootstrap resamples pairs. With `decode`, every source is also translated greedily (`model.generate`, at most
    `max_new_tokens` tokens; default: `translation.default_max_new_tokens` of the targets) and the translations are
    scored against the targets by corpus BLEU and chrF (attnkit/ablation/translation.py), reported beside the
    loss."""

    name = "seq2seq"
    model_task = "seq2seq-lm"
    main_metric = "loss"
    sweeps = False  # an encoder–decoder has two stacks: every setting runs the whole model

    def __init__(self, path: str, decode: bool = False, max_new_tokens: int | None = None):
        self.path = path
        self.examples = read_pairs(path)
        if decode:
            translation.require_sacrebleu()
        elif max_new_tokens is not None:
            raise AttnkitError(f"{arg('max_new_tokens')} is for {arg('decode', True)}")
        self.decode = decode
        self.max_new_tokens = None if max_new_tokens is None else check_int(max_new_tokens, "max_new_tokens")
        self.decoding = None  # the plan's max_new_tokens when decoding

    def segments(self, limit=None) -> list:
        return [self.examples[i] for i in subset(len(self.examples), limit)]

    def _batches(self, model, tokenizer, chosen: list[int], batch_size: int, by_length: bool = True) -> list:
        """(pair indices, Batch, labels) per batch of the pairs `chosen`, sorted by source length (less padding)
        or, without `by_length`, in their order; labels: the targets' tokens (B × target length, −100 on padding),
        the positions the decoder predicts."""
        key = ("pairs", id(tokenizer), tuple(chosen), batch_size, by_length)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            enc = Encoder(tokenizer, max_length=self.max_length, split_sentences=True,
                          decoder_start=pair_decoder_start(model.config))
            pairs = [self.examples[i] for i in chosen]
            order = (np.argsort(self.token_lengths(tokenizer, [s for s, _ in pairs]), kind="stable") if by_length
                     else np.arange(len(pairs)))
            out = []
            for i in range(0, len(order), batch_size):
                idx = order[i:i + batch_size]
                batch = enc([pairs[j] for j in idx])
                target = tokenizer(text_target=[enc.bounded(pairs[j][1]) for j in idx], truncation=True,
                                   max_length=self.max_length, padding="longest", return_tensors="pt",
                                   padding_side="right")
                labels = target["input_ids"].masked_fill(target["attention_mask"] == 0, -100)
                out.append(([chosen[int(j)] for j in idx], batch, labels))
            cache[key] = out
        return cache[key]

    def plan(self, model, tokenizer, limit=None, batch_size=32) -> Plan:
        chosen = subset(len(self.examples), limit)
        steps = [Step(batch, (orig, labels)) for orig, batch, labels in
                 self._batches(model, tokenizer, chosen, batch_size)]
        if self.decode:
            targets = [int((step.info[1] != -100).sum(-1).max()) for step in steps]
            self.decoding = self.max_new_tokens or translation.default_max_new_tokens(targets, self.max_length)
            limit = max_positions(model)  # the decoder's start token takes one of them
            if limit is not None and self.decoding >= limit:
                raise AttnkitError(f"{arg('max_new_tokens')} {self.decoding} runs past the model's {limit} positions "
                                   f"(with the decoder's start token): give at most {limit - 1}")
        return Plan(steps, (len(chosen), tokenizer))

    def outputs(self, model, batch):
        """The teacher-forced logits; with `decode`, also the greedy translations of the batch's sources."""
        logits = forward(model, batch).logits
        if not self.decode:
            return logits
        source = {k: v for k, v in batch.to(_device(model)).inputs.items() if not k.startswith("decoder_")}
        return logits, model.generate(**source, max_new_tokens=self.decoding, do_sample=False, num_beams=1)

    def reduce(self, step, outputs):
        """Per pair of the step: (pair, target tokens, their summed cross-entropy in nats), and with `decode` the
        tokens of its translation."""
        orig, labels = step.info
        logits, generated = outputs if self.decode else (outputs, None)
        nll = torch.nn.functional.cross_entropy(logits.float().cpu().transpose(1, 2), labels, reduction="none",
                                                ignore_index=-100).double()
        n = (labels != -100).sum(-1)
        rows = [(j, int(n[b]), float(nll[b].sum())) for b, j in enumerate(orig)]
        return rows if generated is None else [(*r, generated[b].tolist()) for b, r in enumerate(rows)]

    def summarize(self, plan, parts) -> dict:
        n, tokenizer = plan.info
        out = summarize_token_loss(self, Plan(plan.steps, n), [[r[:3] for r in part] for part in parts],
                                   "no target has a token to predict")
        if self.decode:  # the pairs in the order of the loss's per-example outputs (their index)
            generated = {r[0]: r[3] for part in parts for r in part}
            keys = self.last_examples.index.tolist()
            hypotheses = tokenizer.batch_decode([generated[k] for k in keys], skip_special_tokens=True)
            scores = self.last_examples
            scores.arrays.update(translation.pair_statistics(hypotheses, [self.examples[k][1] for k in keys]))
            scores.arrays["hypothesis"] = np.array(hypotheses, dtype=object)
            scores.others = dict(translation.TRANSLATION_METRICS)
            out.update({name: scores.of(name).value() for name in scores.others})
        return out

    def losses(self, model, tokenizer, limit=None, batch_size=1):
        instrument(model)
        chosen = subset(len(self.examples), limit)
        for _, batch, labels in self._batches(model, tokenizer, chosen, batch_size, by_length=False):
            if (labels != -100).any():
                yield forward(model, batch, labels=labels.to(_device(model))).loss


def get_task(name: str, path, **options) -> Task:
    """Load a task's data from a local file: name in stsb, glue, squad, mlm, lm, seq2seq; `max_length`: the tokens
    per input (default: `task_max_length`); seq2seq's `decode` and `max_new_tokens` (Seq2seqTask)."""
    path = str(path)
    if name != "seq2seq" and (options.get("decode") or options.get("max_new_tokens") is not None):
        raise AttnkitError(f"{arg('decode')} translates with an encoder–decoder: it is for "
                           f"{arg('task_name', 'seq2seq')}, not {name}")
    if name == "stsb":
        task = StsbTask(path)
    elif name == "glue":
        task = GlueTask(path, subtask=options.get("glue_task"))
    elif name == "squad":
        task = SquadTask(path, max_length=task_max_length(name, options.get("max_length")),
                         stride=options.get("stride"))
    elif name == "mlm":
        task = MlmTask(path, seed=options.get("seed") or 0)
    elif name == "lm":
        task = LmTask(path)
    elif name == "seq2seq":
        task = Seq2seqTask(path, decode=bool(options.get("decode")), max_new_tokens=options.get("max_new_tokens"))
    elif name in IMAGE_TASKS:  # built on this module's Task: image_tasks.py imports it, not the other way round
        raise AttnkitError(f"task {name!r} reads images: make it with "
                           "attnkit.ablation.image_tasks.ImageClassificationTask(path)")
    else:
        raise AttnkitError(f"unknown task {name!r}; use one of {', '.join(TASKS)}")
    task.max_length = check_int(task_max_length(name, options.get("max_length")), "max_length", minimum=2)
    task.length_given = options.get("max_length") is not None
    return task
