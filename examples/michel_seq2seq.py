"""Michel et al.'s encoder–decoder findings, reproduced on two CPU cores in a few minutes (docs/seq2seq.md,
"Michel et al. on a laptop"; Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?").

A small Marian (3 encoder and 3 decoder layers, 4 heads of 16, d_model 64), trained from scratch, translates a toy
grammar: an English-like source (subject, verb, object; adjectives before the noun; the plural a token after the
noun) into a target that reorders and inflects (subject and object before the verb, each with a case marker;
adjectives after the noun, in reverse order; a plural marker on nouns; the verb agrees with the subject's number
by a suffix token). The translation is a function of the source, so greedy decoding is scored exactly (exact match
and token accuracy).

The training loop is a plain one under `attnkit.track` (every head's entropy over the training forwards). Every
`--every` steps it measures Michel's importance of every head, I_h = mean |∂L/∂ξ_h| over held-out groups of
`--group` pairs, ξ_h a gate on head h's output (`attnkit.ablation.head_importance`, gates on the encoder's
self-attention, the decoder's self-attention and cross-attention alike), normalised per layer. At the end:
(a) each head masked alone: Δloss and Δaccuracy; (b) iterative pruning by importance of one kind of heads at a
time (Enc-Enc, Dec-Dec, Enc-Dec: `iterative_pruning(..., among=...)`), accuracy against the share of that kind
pruned (Michel's per-kind pruning); (c) the Spearman correlation of each checkpoint's importance with the final one
(Michel's "important heads are determined early"). Into runs/michel_seq2seq/ by default (runs/ is left out of
git): heads.csv (every head at every checkpoint), ablation.csv (the masked-alone and pruning rows), summary.json
and michel_seq2seq.png.

    python examples/michel_seq2seq.py [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: spinning threads crawl on a busy machine
import numpy as np  # noqa: E402
import torch  # noqa: E402

import attnkit  # noqa: E402
from attnkit.ablation import head_importance, iterative_pruning  # noqa: E402
from attnkit.models import layer_kinds  # noqa: E402

# ---- the toy grammar -------------------------------------------------------------------------------------------
NOUNS = {"cat": "neko", "dog": "inu", "bird": "tori", "fox": "kitsu", "horse": "uma", "mouse": "nezu", "wolf": "oka",
         "bear": "kuma", "frog": "kaeru", "duck": "kamo"}
ADJECTIVES = {"big": "ooki", "small": "chisa", "red": "aka", "old": "furu", "happy": "ureshi", "quick": "haya"}
VERBS = {"sees": "mi", "chases": "oi", "likes": "suki", "bites": "kami", "follows": "tsui", "hears": "kiki"}
SOURCE_PLURAL, TARGET_PLURAL = "-s", "-tachi"
SUBJECT_CASE, OBJECT_CASE = "ga", "wo"
AGREEMENT = {False: "-ru", True: "-ra"}  # the verb's suffix: a singular or a plural subject
SPECIALS = ["<pad>", "</s>"]
PAD, EOS = 0, 1
WORDS = SPECIALS + [*NOUNS, *ADJECTIVES, *VERBS, SOURCE_PLURAL] + [*NOUNS.values(), *ADJECTIVES.values(),
                                                                 *VERBS.values(), TARGET_PLURAL, SUBJECT_CASE,
                                                                 OBJECT_CASE, *AGREEMENT.values()]
INDEX = {w: i for i, w in enumerate(WORDS)}
MAX_ADJECTIVES = 2
SOURCE_LEN = 2 * (MAX_ADJECTIVES + 2) + 1 + 1  # two noun phrases, the verb, </s>
TARGET_LEN = 2 * (MAX_ADJECTIVES + 3) + 2 + 1  # two noun phrases with their case, verb and suffix, </s>
KINDS = ("encoder", "decoder", "cross")
KIND_NAMES = {"encoder": "Enc-Enc", "decoder": "Dec-Dec", "cross": "Enc-Dec"}


def noun_phrase(g: np.random.Generator) -> tuple[list[str], bool]:
    """(source words of a noun phrase: adjectives, noun, plural marker; whether it is plural)."""
    adjectives = list(g.choice(list(ADJECTIVES), size=int(g.integers(0, MAX_ADJECTIVES + 1)), replace=False))
    plural = bool(g.integers(0, 2))
    return adjectives + [str(g.choice(list(NOUNS)))] + ([SOURCE_PLURAL] if plural else []), plural


def sentence(g: np.random.Generator) -> list[str]:
    """A source sentence: subject, verb, object."""
    subject, _ = noun_phrase(g)
    obj, _ = noun_phrase(g)
    return subject + [str(g.choice(list(VERBS)))] + obj


def split_noun_phrase(words: list[str]) -> tuple[list[str], int]:
    """The noun phrase at the start of `words` (adjectives, noun, optional plural) and its length."""
    n = 0
    while words[n] in ADJECTIVES:
        n += 1
    n += 1  # the noun
    if n < len(words) and words[n] == SOURCE_PLURAL:
        n += 1
    return words[:n], n


def translate_noun_phrase(words: list[str], case: str) -> list[str]:
    """noun, plural marker, adjectives in reverse order, case marker."""
    plural = words[-1] == SOURCE_PLURAL
    words = words[:-1] if plural else words
    return [NOUNS[words[-1]]] + ([TARGET_PLURAL] if plural else []) + [ADJECTIVES[a] for a in words[-2::-1]] + [case]


def translate(source: list[str]) -> list[str]:
    """The target of a source sentence: subject and object (reordered noun phrases with their case), then the verb
    and its agreement with the subject's number."""
    subject, n = split_noun_phrase(source)
    verb = source[n]
    obj, _ = split_noun_phrase(source[n + 1:])
    return (translate_noun_phrase(subject, SUBJECT_CASE) + translate_noun_phrase(obj, OBJECT_CASE)
            + [VERBS[verb], AGREEMENT[subject[-1] == SOURCE_PLURAL]])


def encode(sentences: list[list[str]], length: int, pad: int) -> torch.Tensor:
    """Token ids with </s> at each end, right-padded with `pad` to `length`."""
    out = torch.full((len(sentences), length), pad, dtype=torch.long)
    for i, words in enumerate(sentences):
        ids = [INDEX[w] for w in words] + [EOS]
        out[i, :len(ids)] = torch.tensor(ids)
    return out


class Pairs:
    """Source ids, their attention mask and the labels (-100 on padding) of some sentences."""

    def __init__(self, sentences: list[list[str]]):
        self.input_ids = encode(sentences, SOURCE_LEN, PAD)
        self.attention_mask = (self.input_ids != PAD).long()
        self.labels = encode([translate(s) for s in sentences], TARGET_LEN, -100)

    def __len__(self):
        return len(self.input_ids)

    def batch(self, start: int, stop: int) -> dict:
        return {"input_ids": self.input_ids[start:stop], "attention_mask": self.attention_mask[start:stop],
                "labels": self.labels[start:stop]}


def held_out_and_training(seed: int, n_held_out: int):
    """A held-out set of distinct sentences and a generator of training batches that never draws one of them."""
    g = np.random.default_rng(seed)
    held, seen = [], set()
    while len(held) < n_held_out:
        s = sentence(g)
        if tuple(s) not in seen:
            seen.add(tuple(s))
            held.append(s)

    def batches(batch: int):
        while True:
            out = []
            while len(out) < batch:
                s = sentence(g)
                if tuple(s) not in seen:
                    out.append(s)
            yield Pairs(out)

    return held, batches


# ---- the model and its measurements ------------------------------------------------------------------------------
def build_model(seed: int, layers: int = 3, d_model: int = 64):
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(seed)
    cfg = MarianConfig(vocab_size=len(WORDS), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
                       decoder_ffn_dim=2 * d_model, max_position_embeddings=32, pad_token_id=PAD, eos_token_id=EOS,
                       decoder_start_token_id=PAD, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       attn_implementation="eager")
    return attnkit.instrument(MarianMTModel(cfg))


def loss_of(model, pairs: Pairs) -> float:
    with torch.no_grad():
        return float(model(**pairs.batch(0, len(pairs))).loss)


def greedy(model, pairs: Pairs) -> torch.Tensor:
    """Greedy decoding of every source, TARGET_LEN tokens (what follows the first </s> is ignored by the scores)."""
    with torch.no_grad():
        enc = model.get_encoder()(input_ids=pairs.input_ids, attention_mask=pairs.attention_mask)
        out = torch.full((len(pairs), 1), model.config.decoder_start_token_id, dtype=torch.long)
        for _ in range(TARGET_LEN):
            logits = model(encoder_outputs=enc, attention_mask=pairs.attention_mask, decoder_input_ids=out).logits
            out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[:, 1:]


def accuracy(model, pairs: Pairs) -> dict:
    """Exact match (the whole target up to its </s>) and token accuracy (the share of the targets' tokens, </s>
    included, that greedy decoding gets right at their position), in per cent."""
    predicted = greedy(model, pairs)
    valid = pairs.labels != -100
    right = (predicted == pairs.labels) & valid
    return {"exact": 100.0 * float((right.sum(1) == valid.sum(1)).float().mean()),
            "token_accuracy": 100.0 * float(right.sum() / valid.sum())}


def evaluate(model, pairs: Pairs, intervention=None) -> dict:
    model.eval()
    with attnkit.intervene(model, intervention or attnkit.Intervention.for_model(model)):
        return {"loss": loss_of(model, pairs), **accuracy(model, pairs)}


def group_losses(model, pairs: Pairs, group: int):
    """The importance's losses: one per group of `group` held-out pairs (Michel et al.: one per example)."""
    def losses():
        model.eval()
        for start in range(0, len(pairs), group):
            yield model(**pairs.batch(start, start + group)).loss
    return losses


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a.ravel(), b.ravel()).statistic)


def kind_grid(model) -> dict:
    """kind → layers × heads booleans, True for the heads of that kind."""
    kinds = [k for k, _ in layer_kinds(model)]
    shape = attnkit.Intervention.for_model(model).shape
    return {k: np.broadcast_to(np.array([x == k for x in kinds])[:, None], shape).copy() for k in KINDS}


# ---- the run ------------------------------------------------------------------------------------------------------
def train(model, a, held: Pairs, importance_pairs: Pairs, batches, start: float):
    """Train under attnkit.track; every `a.every` steps: held-out loss and accuracy, importance and entropy."""
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    warmup = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    checkpoints = []
    with attnkit.track(model, features=("entropy",)) as tracker:
        for step in range(1, a.steps + 1):
            model.train()
            loss = model(**next(batches).batch(0, a.batch)).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % a.every == 0 or step == a.steps:
                entropy = tracker.read()["entropy"].numpy()  # means over the training forwards since the last read
                with tracker.paused():  # the held-out measurements are not training forwards
                    scores = evaluate(model, held)
                    imp = head_importance(model, group_losses(model, importance_pairs, a.group))
                checkpoints.append({"step": step, "train_loss": float(loss.detach()), **scores,
                                    "importance": imp["importance"], "raw": imp["raw"], "entropy": entropy})
                print(f"step {step:5d}  loss {float(loss.detach()):.3f}  held-out loss {scores['loss']:.3f}  exact "
                      f"{scores['exact']:5.1f}%  tokens {scores['token_accuracy']:5.1f}%  "
                      f"({time.time() - start:.0f} s)", flush=True)
    return checkpoints


def masked_alone(model, held: Pairs, base: dict) -> list[dict]:
    """(a) Each head masked alone (mode zero): Δloss, Δexact, Δtoken accuracy."""
    iv = attnkit.Intervention.for_model(model)
    rows = []
    for layer, (kind, _) in enumerate(layer_kinds(model)):
        for head in range(iv.shape[1]):
            r = evaluate(model, held, attnkit.Intervention.from_heads(model, [(layer, head)]))
            rows.append({"experiment": "masked_alone", "kind": kind, "layer": layer, "head": head, "pruned": 1,
                         "share": None, **{k: r[k] for k in ("loss", "exact", "token_accuracy")},
                         "delta_loss": r["loss"] - base["loss"], "delta_exact": r["exact"] - base["exact"],
                         "delta_token_accuracy": r["token_accuracy"] - base["token_accuracy"]})
    return rows


def prune_each_kind(model, held: Pairs, importance_pairs: Pairs, group: int) -> list[dict]:
    """(b) Iterative pruning by importance, one kind of heads at a time, one head per step."""
    rows = []
    for kind, among in kind_grid(model).items():
        res = iterative_pruning(model, lambda iv: evaluate(model, held, iv),
                                group_losses(model, importance_pairs, group), step=1.0 / int(among.sum()), among=among)
        for s in res["steps"]:
            rows.append({"experiment": "prune_" + kind, "kind": kind, "layer": None, "head": None,
                         "pruned": s["pruned"], "share": s["share"], **s["metrics"],
                         "heads": " ".join(f"L{l}H{h}" for l, h in s["heads"])})
        print(f"pruned {KIND_NAMES[kind]}: " + "  ".join(f"{s['share']:.2f}→{s['metrics']['exact']:.0f}%"
                                                         for s in res["steps"]), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--layers", type=int, default=3, help="encoder layers (and decoder layers)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--held-out", type=int, default=256, help="held-out pairs scored at each checkpoint")
    p.add_argument("--importance-pairs", type=int, default=128, help="held-out pairs the importance is taken over")
    p.add_argument("--group", type=int, default=4, help="pairs per loss of the importance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/michel_seq2seq")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    model = build_model(a.seed, a.layers, a.d_model)
    held_sentences, batch_gen = held_out_and_training(a.seed + 1, a.held_out + a.importance_pairs)
    held, importance_pairs = Pairs(held_sentences[:a.held_out]), Pairs(held_sentences[a.held_out:])
    checkpoints = train(model, a, held, importance_pairs, batch_gen(a.batch), start)
    base = {k: checkpoints[-1][k] for k in ("loss", "exact", "token_accuracy")}
    ablations = masked_alone(model, held, base)
    ablations += prune_each_kind(model, held, importance_pairs, a.group)
    write_csvs(model, out, checkpoints, ablations)
    summary = summarize(model, checkpoints, ablations)
    summary["seconds"] = round(time.time() - start, 1)
    summary["command"] = " ".join(["python examples/michel_seq2seq.py", *(sys.argv[1:] if argv is None else argv)])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    figure(checkpoints, ablations, summary, out / "michel_seq2seq.png")
    return summary


def write_csvs(model, out: Path, checkpoints: list[dict], ablations: list[dict]) -> None:
    kinds = layer_kinds(model)
    with open(out / "heads.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "layer", "head", "kind", "index_in_kind", "importance", "raw_importance", "entropy"])
        for c in checkpoints:
            for layer, (kind, index) in enumerate(kinds):
                for head in range(c["importance"].shape[1]):
                    w.writerow([c["step"], layer, head, kind, index, c["importance"][layer, head],
                                c["raw"][layer, head], c["entropy"][layer, head]])
    with open(out / "ablation.csv", "w", newline="") as f:
        fields = ["experiment", "kind", "layer", "head", "pruned", "share", "loss", "exact", "token_accuracy",
                  "delta_loss", "delta_exact", "delta_token_accuracy", "heads"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(ablations)


def settled_step(steps: list[int], correlations: list[float], threshold: float = 0.8) -> int | None:
    """The first checkpoint from which the correlation with the final importance stays ≥ threshold."""
    for i, s in enumerate(steps):
        if all(c >= threshold for c in correlations[i:]):
            return s
    return None


def summarize(model, checkpoints: list[dict], ablations: list[dict]) -> dict:
    final = checkpoints[-1]
    grids = kind_grid(model)
    steps = [c["step"] for c in checkpoints]
    rho = [spearman(c["importance"], final["importance"]) for c in checkpoints]
    rho_kind = {k: [spearman(c["importance"][g], final["importance"][g]) for c in checkpoints]
                for k, g in grids.items()}
    alone, kinds = [r for r in ablations if r["experiment"] == "masked_alone"], {}
    for kind in KINDS:
        mine = [r for r in alone if r["kind"] == kind]
        curve = [r for r in ablations if r["experiment"] == "prune_" + kind]
        half = min(curve, key=lambda r: abs(r["share"] - 0.5))
        kinds[KIND_NAMES[kind]] = {
            "heads": len(mine),
            "masked_alone_mean_delta_loss": round(float(np.mean([r["delta_loss"] for r in mine])), 4),
            "masked_alone_max_delta_loss": round(max(r["delta_loss"] for r in mine), 4),
            "masked_alone_worst_delta_exact": round(min(r["delta_exact"] for r in mine), 2),
            "masked_alone_heads_hurting_exact_by_1pt": sum(r["delta_exact"] <= -1 for r in mine),
            "pruned_half_share": round(half["share"], 3), "pruned_half_exact": round(half["exact"], 2),
            "pruned_half_token_accuracy": round(half["token_accuracy"], 2),
            "pruned_all_exact": round(curve[-1]["exact"], 2),
            "pruned_all_token_accuracy": round(curve[-1]["token_accuracy"], 2),
            # the mean accuracy over the curve's shares (its area): the kind the model can least lose has the lowest
            "pruning_curve_mean_token_accuracy": round(float(np.mean([r["token_accuracy"] for r in curve])), 2),
            "final_mean_importance": round(float(final["importance"][grids[kind]].mean()), 4),
        }
    least = min(kinds, key=lambda k: kinds[k]["pruning_curve_mean_token_accuracy"])
    settled = settled_step(steps, rho)
    return {
        "final": {k: round(final[k], 3) for k in ("loss", "exact", "token_accuracy")},
        "kinds": kinds,
        "kind_model_can_least_lose": least,
        "cross_attention_least_losable": least == "Enc-Dec",
        "importance_spearman_with_final": {str(s): round(r, 3) for s, r in zip(steps, rho)},
        "importance_spearman_with_final_by_kind": {KIND_NAMES[k]: {str(s): round(r, 3) for s, r in zip(steps, v)}
                                                   for k, v in rho_kind.items()},
        "step_importance_settles": settled,
        "share_of_training_when_settled": None if settled is None else round(settled / steps[-1], 3),
        "step_exact_reaches_90pct_of_final": next((c["step"] for c in checkpoints
                                                   if c["exact"] >= 0.9 * final["exact"]), None),
    }


def figure(checkpoints: list[dict], ablations: list[dict], summary: dict, path: Path) -> None:
    from attnkit.plotting import plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for kind in KINDS:
        curve = [r for r in ablations if r["experiment"] == "prune_" + kind]
        line = axes[0].plot([r["share"] * 100 for r in curve], [r["token_accuracy"] for r in curve], marker="o",
                            markersize=3, label=KIND_NAMES[kind])[0]
        axes[0].plot([r["share"] * 100 for r in curve], [r["exact"] for r in curve], linestyle="--",
                     color=line.get_color())
    axes[0].set_xlabel("heads of that kind pruned (%)")
    axes[0].set_ylabel("held-out accuracy (%)\n(solid: tokens, dashed: exact)")
    axes[0].set_title("iterative pruning by importance", fontsize=10)
    axes[0].legend(fontsize=8)
    alone = [r for r in ablations if r["experiment"] == "masked_alone"]
    for i, kind in enumerate(KINDS):
        deltas = [r["delta_loss"] for r in alone if r["kind"] == kind]
        axes[1].scatter(np.full(len(deltas), i) + np.linspace(-0.2, 0.2, len(deltas)), deltas, s=12)
    axes[1].set_xticks(range(3), [KIND_NAMES[k] for k in KINDS])
    lowest, highest = min(r["delta_loss"] for r in alone), max(r["delta_loss"] for r in alone)
    axes[1].set_yscale("symlog", linthresh=0.01)
    axes[1].set_ylim(min(2 * lowest, -1e-3), max(2 * highest, 1e-2))
    axes[1].set_ylabel("Δ held-out loss (nats, symlog)")
    axes[1].set_title("each head masked alone", fontsize=10)
    steps = [c["step"] for c in checkpoints]
    axes[2].plot(steps, [summary["importance_spearman_with_final"][str(s)] for s in steps], color="black",
                 label="all heads")
    for kind in KINDS:
        by_kind = summary["importance_spearman_with_final_by_kind"][KIND_NAMES[kind]]
        axes[2].plot(steps, [by_kind[str(s)] for s in steps], linewidth=0.8, label=KIND_NAMES[kind])
    twin = axes[2].twinx()
    twin.plot(steps, [c["exact"] for c in checkpoints], color="grey", linestyle=":", label="exact match (%)")
    twin.set_ylabel("held-out exact match (%, dotted)")
    axes[2].set_xlabel("training step")
    axes[2].set_ylabel("Spearman ρ with final importance")
    axes[2].set_title("importance during training", fontsize=10)
    axes[2].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
