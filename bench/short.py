"""Benchmark: extraction on sentence-length inputs (issue 29), side by side in one process.

    python bench/short.py [--texts held-out|stsb] [--stsb PATH] [--n 1000] [--batch 16] [--repeats 5]
    python bench/short.py --regimes [--n 200]     the mechanism: the same sdpa forwards in three OpenMP regimes

Configurations, interleaved (the order rotates every round), medians after one warm-up round, all on the main
thread of this process, MiniLM (the embedded model) loaded before the clock starts:
  sdpa      the plain sdpa forward of the batches attnkit plans (length-sorted, pre-tokenised): no features
  naive     a user's first script: texts sorted by length, each batch tokenised, an eager forward with
            output_attentions=True and the features computed from the returned maps in plain PyTorch
            (bench/extract.py's `naive_features`), summed over the samples
  extract   attnkit.extract(texts, (model, tokenizer), batch_size=...)
  thread    attnkit.extract called from a second thread of this process (whose main thread has run torch): the
            OpenMP regime the device thread of attnkit <= 0.x had, and a user calling from a thread
  cli       `attnkit extract` as the command runs it (its job, in this process: options → run directory; the
            figure is the time the command reports for its extraction, model loading excluded)
Texts: "held-out" builds sentences of 9-12 words from windows of the words of attnkit/data/default_corpus.txt
(so about 12-15 tokens with [CLS] and [SEP]); "stsb" takes the first sentences of GLUE STS-B dev (--stsb, by
default ../shared/data/stsb/dev.tsv beside the repository). The load average is printed with every figure:
the machine may be shared.

--regimes: the plain sdpa forward of the same batches on the main thread alone (libgomp's waits spin), on the main
thread while a parked thread holds a second OpenMP team (waits spin 100 rounds, then sleep), and on a second
thread (the device thread attnkit <= 0.x ran CPU forwards on; also sleeping waits), with the context switches of
the process per batch (getrusage): a count that does not depend on the machine's load.

--waits: how torch's OpenMP threads wait (attnkit/engine/openmp.py). "auto": as attnkit runs (short waits only
while the CPUs are oversubscribed, the baselines as they come); "short": every configuration with short waits
(a parked OpenMP team held throughout), "spin": attnkit never parks a team. On a busy machine "short" compares
the configurations in the regime that is fast there; on free cores "auto" and "spin" are the same.
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

import torch  # noqa: E402

CONFIGS = ("sdpa", "naive", "extract", "cli")  # and "thread"
ROOT = Path(__file__).resolve().parent.parent


def load() -> str:
    """The 1-minute load average and the kernel's CPU pressure (attnkit/engine/openmp.py)."""
    try:
        with open("/proc/pressure/cpu") as f:
            pressure = f", cpu pressure {f.readline().split()[1].split('=')[1]}%"
    except OSError:
        pressure = ""
    return f"load {os.getloadavg()[0]:.2f}{pressure}"


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


def regimes(forward, n_batches: int, repeats: int) -> None:
    import resource

    import attnkit.engine.openmp as openmp

    def switches() -> int:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_nvcsw + r.ru_nivcsw

    def timed(run):
        c0, t0 = switches(), time.perf_counter()
        run()
        return time.perf_counter() - t0, (switches() - c0) / n_batches

    def parked():
        waits = openmp.ShortWaits(torch.get_num_threads())
        waits.hold()
        try:
            return timed(forward)
        finally:
            waits.release()

    def on_thread():
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("r", timed(forward)))
        th.start()
        th.join()
        return out["r"]

    runs = {"main thread alone": lambda: timed(forward), "main + parked team": parked, "second thread": on_thread}
    res: dict = {k: [] for k in runs}
    forward()
    for r in range(repeats):
        for k, run in runs.items():
            res[k].append(run())
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in res.items()) + f" ({load()})",
              flush=True)
    print(f"medians of {repeats} ({load()}):")
    for k, v in res.items():
        print(f"  {k:20s} {statistics.median(a for a, _ in v):6.2f} s, "
              f"{statistics.median(b for _, b in v):6.1f} context switches per batch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", choices=["held-out", "stsb"], default="held-out")
    ap.add_argument("--stsb", default=str(ROOT.parent / "shared" / "data" / "stsb" / "dev.tsv"))
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workers", type=int, default=None, help="cli: --workers (default: the command's default)")
    ap.add_argument("--waits", choices=["auto", "short", "spin"], default="auto")
    ap.add_argument("--regimes", action="store_true", help="time the three OpenMP regimes (see above)")
    args = ap.parse_args()
    configs = args.configs.split(",")

    from extract import naive_features  # bench/extract.py
    from transformers import AutoModel, AutoTokenizer

    import attnkit
    import attnkit.engine.openmp as openmp
    from attnkit.engine.extract_job import ExtractOptions, run_extract_job
    from attnkit.engine.plan import plan_batches
    from attnkit.models import default_model_path
    from attnkit.tokens import Encoder

    texts = held_out_sentences(args.n) if args.texts == "held-out" else stsb_sentences(Path(args.stsb), args.n)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model, _ = attnkit.load_model(None, device="cpu")
    sdpa = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    enc = Encoder(tok, max_length=128)
    batches = [enc(pb.segments) for pb in plan_batches(texts, args.batch, 4096)]
    n_tokens = sum(b.n_tokens for b in batches)
    ids = {"cls": tok.cls_token_id, "sep": tok.sep_token_id, "comma": tok.convert_tokens_to_ids(","),
           "period": tok.convert_tokens_to_ids(".")}
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-short-"))
    corpus = tmp / "texts.txt"
    corpus.write_text("\n".join(texts) + "\n")
    print(f"waits: {args.waits}; {len(texts)} {args.texts} texts, {n_tokens} tokens "
          f"({n_tokens / len(texts):.1f} per text), "
          f"{len(batches)} batches of {args.batch}, torch threads {torch.get_num_threads()}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {load()}")

    def run_sdpa():
        with torch.inference_mode():
            for b in batches:
                sdpa(**b.inputs)

    def run_naive():
        order = sorted(texts, key=len, reverse=True)
        total = None
        with torch.inference_mode():
            for i in range(0, len(order), args.batch):
                x = tok(order[i:i + args.batch], padding=True, truncation=True, max_length=128, return_tensors="pt")
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
        return attnkit.extract(texts, (model, tok), batch_size=args.batch)

    def run_cli():
        msgs = []
        run_extract_job(ExtractOptions(paths=[str(corpus)], batch_size=args.batch, out=tmp / "run", overwrite=True,
                                       quiet=True, workers=args.workers), echo=lambda t, err=False: msgs.append(t))
        return float(re.search(r" in ([0-9.]+)s", " ".join(msgs)).group(1))

    def run_thread():
        th = threading.Thread(target=run_extract)
        th.start()
        th.join()

    if args.regimes:
        return regimes(run_sdpa, len(batches), args.repeats)

    runs = {"sdpa": run_sdpa, "naive": run_naive, "extract": run_extract, "cli": run_cli, "thread": run_thread}
    parked = openmp.ShortWaits(torch.get_num_threads())
    if args.waits != "auto":
        openmp.cpu_oversubscribed = lambda: False  # attnkit's own policy: never park (short: the bench holds one)
    if args.waits == "short":
        parked.hold()
    ak = run_extract()
    nv = run_naive()
    diff = float((nv.numpy() - ak.mean).__abs__().max())
    print(f"naive and attnkit mean features differ by at most {diff:.1e}")
    times: dict = {c: [] for c in configs}
    for r in range(args.repeats):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            t0 = time.perf_counter()
            reported = runs[c]()
            dt = time.perf_counter() - t0
            times[c].append(reported if c == "cli" else dt)
        print(f"  round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in configs) + f" ({load()})",
              flush=True)
    parked.release()
    med = {c: statistics.median(v) for c, v in times.items()}
    print(f"medians of {args.repeats} ({load()}):")
    for c in configs:
        rel = [f"{med[c] / med[b]:.2f}x {b}" for b in ("naive", "sdpa") if b in med and b != c]
        print(f"  {c:8s} {med[c]:6.2f} s  {n_tokens / med[c]:8,.0f} tok/s  " + ", ".join(rel))


if __name__ == "__main__":
    main()
