"""Induction heads forming while a model trains, watched with attnkit (docs/training.md, "The induction-head phase
change"; Olsson et al. 2022, scaled down to run on two CPU cores in a few minutes).

A 2-layer attention-only transformer (a Llama block with its MLP removed: rotary positions, RMSNorm, 4 heads of 16)
learns sequences made of a random span of R tokens (R drawn from 8 … 32) repeated to fill 64 tokens: a token
after the first copy is predictable only by finding its earlier occurrence and copying the token after it.
The training loop is a plain one under `attnkit.track`, which gives every head's entropy and max logit over the
training forwards; every `--every` steps, on held-out sequences (a span of 32 repeated once), it measures each
head's induction score (the op's mass on the target key s − R + 1, `attnkit.detect_heads`) and previous-token
mass, and the in-context-learning score: the mean loss over the second copy's tokens minus that over the first
copy's (Olsson et al.'s "late minus early" loss). It prints the step at which each curve passes halfway between
its first and last value, and writes a CSV of every head at every log step and a figure, into runs/induction_heads/
by default (runs/ is left out of git by .gitignore).

    python examples/induction_heads.py [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: spinning threads crawl on a busy machine
import torch  # noqa: E402
from torch import nn  # noqa: E402

import attnkit  # noqa: E402
from attnkit.training import StatsLogger, track  # noqa: E402

VOCAB, SEQ, EVAL_R = 64, 64, 32


class NoMLP(nn.Module):
    """Takes the place of a block's MLP: the block adds nothing after attention (attention-only)."""

    def forward(self, x):
        return torch.zeros_like(x)


class IdsOnly:
    """attnkit.detect_heads takes the held-out ids as they are; it asks for a tokenizer only to draw its own."""

    all_special_ids: list = []


def build_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=4, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.mlp = NoMLP()
    return attnkit.instrument(model)


def repeated_spans(n: int, g: torch.Generator, r_min: int = 8, r_max: int = 32) -> torch.Tensor:
    """n sequences of SEQ tokens: a random span of R tokens (R uniform in r_min … r_max) repeated to fill SEQ."""
    out = torch.empty(n, SEQ, dtype=torch.long)
    for i in range(n):
        R = int(torch.randint(r_min, r_max + 1, (1,), generator=g))
        span = torch.randint(0, VOCAB, (R,), generator=g)
        out[i] = span.repeat(SEQ // R + 1)[:SEQ]
    return out


def icl_score(model, ids: torch.Tensor) -> tuple[float, float]:
    """(mean loss over the second copy − mean loss over the first copy's predictable-free tokens, eval loss)."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    loss = loss.view(ids.shape[0], -1)  # position p predicts token p + 1
    early = loss[:, 1:EVAL_R - 1].mean()  # tokens 2 … R − 1: first copy, nothing to copy yet
    late = loss[:, EVAL_R:].mean()  # tokens R + 1 … 2R − 1: the second copy
    return float(late - early), float(loss.mean())


def halfway_step(steps, values) -> int | None:
    """The first logged step at which `values` has covered half of its way from the first to the last value."""
    first, last = values[0], values[-1]
    if abs(last - first) < 1e-9:
        return None
    for s, v in zip(steps, values):
        if (v - first) / (last - first) >= 0.5:
            return s
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/induction_heads")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed + 1)
    held_out = repeated_spans(64, torch.Generator().manual_seed(10_000), EVAL_R, EVAL_R)  # r r, R = 32
    held_out = held_out[:, :2 * EVAL_R]
    rows, log = [], StatsLogger(out / "heads.csv")
    start = time.time()
    with track(model, features=("entropy", "max_logit")) as tracker:
        for step in range(1, a.steps + 1):
            model.train()
            ids = repeated_spans(a.batch, g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % a.every == 0 or step == 1:
                stats = tracker.read()  # means over the training forwards since the last read (max for max_logit)
                with tracker.paused():  # the held-out measurements are not training forwards
                    heads = attnkit.detect_heads((model, IdsOnly()), kinds=("previous", "induction"),
                                                 input_ids=held_out)  # (it puts the model in eval mode)
                    icl, eval_loss = icl_score(model, held_out)
                stats["induction"] = torch.tensor(heads["induction"].to_numpy(), dtype=torch.float32).view(2, 4)
                stats["previous"] = torch.tensor(heads["previous"].to_numpy(), dtype=torch.float32).view(2, 4)
                log.log(step, stats)
                rows.append({"step": step, "train_loss": float(loss.detach()), "eval_loss": eval_loss, "icl": icl,
                             **{f"{k}_L{layer}H{h}": float(v[layer, h]) for k, v in stats.items()
                                for layer in range(2) for h in range(4)}})
                print(f"step {step:5d}  loss {float(loss.detach()):.3f}  icl {icl:+.3f}  induction max "
                      f"{float(stats['induction'].max()):.2f}  previous max {float(stats['previous'].max()):.2f}  "
                      f"({time.time() - start:.0f} s)", flush=True)
    log.close()
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    summary = summarize(rows)
    summary["seconds"] = round(time.time() - start, 1)
    summary["command"] = "python examples/induction_heads.py " + " ".join(argv or [])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    figure(rows, summary, out / "induction.png")


def summarize(rows) -> dict:
    steps = [r["step"] for r in rows]
    last = rows[-1]
    induction = {k[len("induction_"):]: last[k] for k in last if k.startswith("induction_")}
    previous = {k[len("previous_"):]: last[k] for k in last if k.startswith("previous_")}
    top_ind = max(induction, key=induction.get)
    top_prev = max(previous, key=previous.get)
    return {
        "induction_heads": sorted(h for h, v in induction.items() if v > 0.3),
        "previous_token_heads": sorted(h for h, v in previous.items() if v > 0.3),
        "top_induction_head": top_ind, "top_previous_head": top_prev,
        "step_induction_halfway": halfway_step(steps, [r[f"induction_{top_ind}"] for r in rows]),
        "step_previous_halfway": halfway_step(steps, [r[f"previous_{top_prev}"] for r in rows]),
        "step_icl_halfway": halfway_step(steps, [r["icl"] for r in rows]),
        "step_loss_halfway": halfway_step(steps, [r["eval_loss"] for r in rows]),
        "first": {k: round(rows[0][k], 3) for k in ("icl", "eval_loss", f"induction_{top_ind}", f"previous_{top_prev}",
                                                     f"entropy_{top_ind}")},
        "last": {k: round(last[k], 3) for k in ("icl", "eval_loss", f"induction_{top_ind}", f"previous_{top_prev}",
                                                 f"entropy_{top_ind}")},
    }


def figure(rows, summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    axes[0].plot(steps, [r["eval_loss"] for r in rows], label="held-out loss")
    axes[0].plot(steps, [r["icl"] for r in rows], label="in-context-learning score (late − early loss)")
    for name, ax, label in (("induction", axes[1], "induction score"), ("previous", axes[2], "previous-token mass"),
                            ("entropy", axes[3], "entropy (nats, training)")):
        for layer in range(2):
            for h in range(4):
                ax.plot(steps, [r[f"{name}_L{layer}H{h}"] for r in rows], label=f"L{layer}H{h}",
                        linestyle="-" if layer else "--")
        ax.set_ylabel(label)
    for ax in axes:
        s = summary["step_induction_halfway"]
        if s is not None:
            ax.axvline(s, color="grey", linewidth=0.8)
        ax.legend(fontsize=6, ncol=4)
    axes[-1].set_xlabel("training step")
    fig.suptitle("2-layer attention-only transformer on repeated random spans")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
