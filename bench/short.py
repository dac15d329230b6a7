"""Benchmark: extraction on sentence-length inputs (issues 29, 38), side by side in one process.

    python bench/short.py [--texts stsb|held-out] [--stsb PATH] [--n 1000] [--batch 16] [--repeats 5]

Configurations, interleaved (the order rotates every round), medians after one warm-up round, all on the main
thread of this process, MiniLM (the embedded model) loaded before the clock starts. Tokenisation is inside every
timing except sdpa-pre's:
  sdpa      the texts sorted by length, each batch tokenised by the tokenizer, the plain sdpa forward: no features
  sdpa-pre  the plain sdpa forward of the batches attnkit runs (its plan's units cut by tokens), tokenised before
            the clock starts
  naive     a user's first script: texts sorted by length, each batch tokenised, an eager forward with
            output_attentions=True and the features computed from the returned maps in plain PyTorch
            (bench/extract.py's `naive_features`), summed over the samples
  extract   attnkit.extract(texts, (model, tokenizer), batch_size=...)
  thread    attnkit.extract called from a second thread of this process
  cli       `attnkit extract` as the command runs it (its job, in this process: options → run directory; the
            figure is the time the command reports for its extraction, model loading excluded)
Texts: "stsb" (default) takes the first sentences of GLUE STS-B dev (--stsb, by default ../shared/data/stsb/dev.tsv
beside the repository: about 15 tokens with [CLS] and [SEP]); "held-out" builds sentences of 9-12 words from
windows of the words of attnkit/data/default_corpus.txt.

How torch's threads wait is decided once, before torch loads, by attnkit's rule (attnkit/engine/openmp.py, as
every command does; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment win), so every configuration runs in
the same regime; the line at the start names it. The CPU model and the load average are printed with every
figure, and CPU time (both threads) beside wall time: the machine may be shared.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

try:
    import attnkit  # noqa: F401
except ImportError:  # run from a source checkout: python bench/short.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attnkit.engine.openmp import configure  # noqa: E402

REGIME = configure()  # before torch loads: libgomp reads the variables once

import torch  # noqa: E402

CONFIGS = ("sdpa", "sdpa-pre", "naive", "extract", "cli")  # and "thread"
ROOT = Path(__file__).resolve().parent.parent
STSB = ROOT.parent / "shared" / "data" / "stsb" / "dev.tsv"  # GLUE STS-B dev beside the repository


def load() -> str:
    """The 1-minute load average and the kernel's CPU pressure (attnkit/engine/openmp.py)."""
    try:
        with open("/proc/pressure/cpu") as f:
            pressure = f", cpu pressure {f.readline().split()[1].split('=')[1]}%"
    except OSError:
        pressure = ""
    return f"load {os.getloadavg()[0]:.2f}{pressure}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def held_out_sentences(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 9-12 words: windows of the built-in corpus's words, starting anywhere (so mostly text the
    corpus never holds as a sentence)."""
    from attnkit.corpus import default_corpus_path

    words = re.findall(r"[A-Za-z][A-Za-z'-]*|,", default_corpus_path().read_text())
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        k = int(rng.integers(9, 13))
        i = int(rng.integers(0, len(words) - k))
        w = [x for x in words[i:i + k] if x != ","] or ["text"]
        out.append(" ".join(w).capitalize() + ".")
    return out


def stsb_sentences(path: Path, n: int) -> list[str]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence1"] for r in rows][:n]


def texts_for(kind: str, stsb: str | Path, n: int) -> list[str]:
    """The `n` texts of --texts `kind`: STS-B dev's first sentences, or held-out sentences of the built-in corpus."""
    return held_out_sentences(n) if kind == "held-out" else stsb_sentences(Path(stsb), n)


def measure(texts: list[str], kind: str = "stsb", batch: int = 16, repeats: int = 5, configs=CONFIGS,
            workers: int | None = None) -> dict:
    """Time `configs` on `texts` (the module docstring), interleaved, printing every round. Returns the medians:
    {"n_texts", "n_tokens", "max_abs_diff" (naive vs attnkit mean features), "wall": {config: s},
    "cpu": {config: s}}."""
    configs = list(configs)
    from extract import naive_features  # bench/extract.py
    from transformers import AutoModel, AutoTokenizer

    import attnkit
    from attnkit.engine.forward import length_batches
    from attnkit.engine.plan import plan_batches
    from attnkit.jobs.extract_job import ExtractOptions, run_extract_job
    from attnkit.models import default_model_path
    from attnkit.tokens import Batch, Encoder

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model, _ = attnkit.load_model(None, device="cpu")
    sdpa = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    enc = Encoder(tok, max_length=128)
    batches = []  # the forwards attnkit runs: the units of its plan, each cut by tokens (attnkit/engine/plan.py)
    for pb in plan_batches(texts, batch, 4096, grouped=True):
        arrays = enc.encode_arrays(pb.segments)
        parts = length_batches(arrays.lengths, batch) or [np.arange(len(pb.segments))]
        batches += [Batch.from_arrays(arrays.rows(p)) for p in parts]
    n_tokens = sum(b.n_tokens for b in batches)
    ids = {"cls": tok.cls_token_id, "sep": tok.sep_token_id, "comma": tok.convert_tokens_to_ids(","),
           "period": tok.convert_tokens_to_ids(".")}
    scratch = tempfile.TemporaryDirectory(prefix="attnkit-short-")  # removed on return or error
    tmp = Path(scratch.name)
    corpus = tmp / "texts.txt"
    corpus.write_text("\n".join(texts) + "\n")
    print(f"{cpu_model()}; waits: {REGIME}; {len(texts)} {kind} texts, {n_tokens} tokens "
          f"({n_tokens / len(texts):.1f} per text), "
          f"{len(batches)} batches of {batch}, torch threads {torch.get_num_threads()}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {load()}")

    def run_sdpa_pre():
        with torch.inference_mode():
            for b in batches:
                sdpa(**b.inputs)

    def run_sdpa():
        order = sorted(texts, key=len, reverse=True)
        with torch.inference_mode():
            for i in range(0, len(order), batch):
                sdpa(**tok(order[i:i + batch], padding=True, truncation=True, max_length=128,
                           return_tensors="pt"))

    def run_naive():
        order = sorted(texts, key=len, reverse=True)
        total = None
        with torch.inference_mode():
            for i in range(0, len(order), batch):
                x = tok(order[i:i + batch], padding=True, truncation=True, max_length=128, return_tensors="pt")
                out = eager(**x, output_attentions=True)
                x_ids = x["input_ids"]
                cls = torch.zeros_like(x_ids, dtype=torch.int32)
                for c, name in enumerate(("cls", "sep", "comma", "period"), start=1):
                    cls[x_ids == ids[name]] = c
                lengths = x["attention_mask"].sum(1)
                feats = naive_features(out.attentions, lengths, cls, torch.zeros_like(cls)).sum(0)
                total = feats if total is None else total + feats
        return total / len(order)

    def run_extract():
        return attnkit.extract(texts, (model, tok), batch_size=batch)

    def run_cli():
        msgs = []
        run_extract_job(ExtractOptions(paths=[str(corpus)], batch_size=batch, out=tmp / "run", overwrite=True,
                                       quiet=True, workers=workers), echo=lambda t, err=False: msgs.append(t))
        return float(re.search(r" in ([0-9.]+)s", " ".join(msgs)).group(1))

    def run_thread():
        th = threading.Thread(target=run_extract)
        th.start()
        th.join()

    runs = {"sdpa": run_sdpa, "sdpa-pre": run_sdpa_pre, "naive": run_naive, "extract": run_extract, "cli": run_cli,
            "thread": run_thread}
    ak = run_extract()
    nv = run_naive()
    diff = float((nv.numpy() - ak.mean).__abs__().max())
    print(f"naive and attnkit mean features differ by at most {diff:.1e}")
    for c in configs:  # warm-up round
        runs[c]()
    times: dict = {c: [] for c in configs}
    cpu: dict = {c: [] for c in configs}
    for r in range(repeats):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            t0, c0 = time.perf_counter(), time.process_time()
            reported = runs[c]()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            times[c].append(reported if c == "cli" else dt)
            cpu[c].append(dc)
        print(f"  round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in configs) + f" ({load()})",
              flush=True)
    med = {c: statistics.median(v) for c, v in times.items()}
    mcpu = {c: statistics.median(v) for c, v in cpu.items()}
    print(f"medians of {repeats} ({cpu_model()}, {load()}; wall, then CPU time of both threads):")
    for c in configs:
        rel = [f"{med[c] / med[b]:.2f}x {b} (CPU {mcpu[c] / mcpu[b]:.2f}x)" for b in ("naive", "sdpa")
               if b in med and b != c]
        print(f"  {c:8s} {med[c]:6.2f} s (CPU {mcpu[c]:6.2f} s) {n_tokens / med[c]:8,.0f} tok/s  " + ", ".join(rel))
    return {"n_texts": len(texts), "n_tokens": n_tokens, "max_abs_diff": diff, "wall": med, "cpu": mcpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", choices=["held-out", "stsb"], default="stsb")
    ap.add_argument("--stsb", default=str(STSB))
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workers", type=int, default=None, help="cli: --workers (default: the command's default)")
    args = ap.parse_args()
    measure(texts_for(args.texts, args.stsb, args.n), args.texts, args.batch, args.repeats, args.configs.split(","),
            args.workers)


if __name__ == "__main__":
    main()
