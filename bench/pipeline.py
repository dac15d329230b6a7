"""Benchmark: the corpus-scale extraction pipeline (issue 9).

    python bench/pipeline.py overlap  [--corpus FILE] [--repeats 3]     tokenisation overlapped with a device
    python bench/pipeline.py padding  FILE [FILE ...]                    padding of windowed vs global sorting
    python bench/pipeline.py memory   [--sizes 50,500]                   peak RSS over generated corpora
    python bench/pipeline.py ray      [--corpus FILE]                    Ray local cluster vs the in-process loop
    python bench/pipeline.py gpu      [--corpus FILE]                    (GPU) extraction vs plain sdpa forward
    python bench/pipeline.py workers  [--trees OLD,NEW]                  --workers 0 vs N, main thread vs a thread
    python bench/pipeline.py plan     [--plan-size-mb 8] [--stsb PATH]    the chosen pipeline vs fixed ones (issue 38)
                                      [--plan-cases tokenise-bound,forward-bound]
    python bench/pipeline.py spike    [--plan-size-mb 48] [--spike-seconds 4]  a neighbour busy for the first
                                      [--stop-share 0.11]                      seconds only, and a resume under it

overlap: the model is replaced by a stand-in that takes, per batch, the time a device would need at R tokens/s
  and leaves the CPU idle (it sleeps). T, one worker's tokenisation rate (one process, the Rust tokenizer's
  own threads off as in a worker), is measured in the same run and
  R = 1.5·T. Tokens/s end to end are reported for --workers 0 (tokenise, then run the device, in turn: at most
  T·R/(T+R) = 0.6·T = 0.4·R) and --workers 1, 2 (tokenisation ahead of the device in worker processes). Medians of
  --repeats runs, interleaved.
padding: padded tokens / real tokens when batches are cut from length-sorted windows of W segments, for several
  W, against one global sort (the old loop), with the embedded MiniLM's tokenizer at --max-length; and of the
  forwards extraction runs (the units of the grouped plan, each cut by tokens: attnkit/engine/plan.py).
memory: `attnkit extract` with a tiny random BERT over generated corpora of the given sizes (MB), each in a fresh
  process; peak RSS of the largest process (resource.getrusage of the children).
ray: the same corpus through `--engine ray` on a local cluster and through the in-process loop (tokens/s).
gpu: BERT-base (random weights) at --dtype bf16, L=128: attnkit extraction end to end (tokenisation workers,
  pinned copies) vs a plain sdpa forward over the same pre-tokenised batches on the device.
workers: --workers 0 against --workers N (the tiny model of `memory`): the same pre-tokenised forwards on the main
  thread and on a thread of their own, then `attnkit extract` end to end from each of --trees.
plan: `attnkit extract` with its own choice of workers and threads (default options) against fixed
  configurations (--configs, workers/threads), a fresh process each, interleaved, on two cases: "tokenise-bound"
  (--plan-size-mb of generated lines, a 1-layer random BERT with hidden size 16) and "forward-bound" (MiniLM on the
  sentences of STS-B dev, both columns, --stsb). For the tokenise-bound case also the 2-core limit: (tokenising
  alone on one core + the forwards alone, pre-tokenised, with every thread) / 2. Figures are the seconds each run
  reports (start-up and model loading excluded), medians of --repeats; the line each run printed about its choice
  is shown once per case.
spike: the tokenise-bound case of `plan` (default options) on the machine as it is, then beside a 2-thread torch
  process that is busy for --spike-seconds from the moment the run has loaded its model (its "attnkit extract:"
  line: the spike covers the plan's measuring) and then exits (issue 46); then the same run interrupted (SIGINT)
  --stop-share of its quiet time into it, and its checkpoint resumed twice, quiet and under the same spike. Each
  ratio is to the quiet run (the quiet resume for the resume); meta.json's `pipeline` of each run says what was
  chosen and each change of plan. Seconds are those the run reports, medians of --repeats, interleaved.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import attnkit  # noqa: F401
except ImportError:  # run from a source checkout: python bench/pipeline.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from attnkit.engine.openmp import configure

configure()  # how torch's threads wait, as every command decides it (before torch loads)
import torch  # noqa: E402

WORDS = ("the river bridge bread harbour library glacier orchestra market lighthouse forest of and to in a was "
         "quiet near far old new city music across under water stone light winter summer people town").split()


def generated_lines(n_bytes: int, seed: int = 0):
    """English-like lines of 5-60 words, about `n_bytes` in all."""
    rng = np.random.default_rng(seed)
    size = 0
    while size < n_bytes:
        n = int(rng.integers(5, 60))
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), n)]
        line = " ".join(words).capitalize() + ("." if rng.random() < 0.8 else ", and more.") + "\n"
        size += len(line)
        yield line


def corpus_segments(path: str | None, n: int) -> list:
    from attnkit.corpus import read_corpus

    if path:  # real text, repeated to n segments where the file holds fewer
        real = read_corpus(path)
        return (real * -(-n // len(real)))[:n]
    return [line.strip() for _, line in zip(range(n), generated_lines(10**9))]


# --- overlap ---------------------------------------------------------------------------------------------
class _Stub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))


def overlap(args) -> dict:
    from transformers import AutoTokenizer

    from attnkit.engine.local import run_pipeline
    from attnkit.engine.plan import plan_batches
    from attnkit.models import default_model_path
    from attnkit.tokens import Encoder

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # T is one worker's rate: one core, as in a worker process
    tok = AutoTokenizer.from_pretrained(default_model_path())
    segments = corpus_segments(args.corpus, args.segments)
    encoder = Encoder(tok, max_length=args.max_length)
    planned = list(plan_batches(segments, args.batch_size, 4096))

    def tokenise_rate() -> float:
        t0 = time.perf_counter()
        n = sum(encoder.encode_arrays(pb.segments).n_tokens for pb in planned)
        return n / (time.perf_counter() - t0)

    tokenise_rate()  # warm-up
    T = statistics.median(tokenise_rate() for _ in range(3))
    R = 1.5 * T

    def device(model, batch):  # the stand-in: the time a device at R tokens/s needs, CPU idle
        time.sleep(batch.n_tokens / R)
        return torch.zeros(batch.lengths.shape[0], 1, 1, 1)

    def end_to_end(workers: int) -> float:
        n = [0]

        def on_result(res):
            n[0] += res.n_tokens

        t0 = time.perf_counter()
        run_pipeline([_Stub()], encoder, iter(planned), device, workers=workers, on_result=on_result)
        return n[0] / (time.perf_counter() - t0)

    rates = {w: [] for w in args.workers}
    for _ in range(args.repeats):
        for w in args.workers:
            rates[w].append(end_to_end(w))
    out = {"T_tokenise_tok_s": T, "R_device_tok_s": R, "segments": len(segments)}
    print(f"one-process tokenisation T = {T:,.0f} tok/s; stand-in device R = 1.5·T = {R:,.0f} tok/s; "
          f"plain-loop bound T·R/(T+R) = {T * R / (T + R):,.0f} ({T / (T + R):.2f}·R)")
    for w, r in rates.items():
        med = statistics.median(r)
        out[f"workers_{w}_tok_s"] = med
        print(f"  --workers {w}: {med:,.0f} tok/s end to end = {med / R:.2f}·R   (runs: "
              + ", ".join(f"{x:,.0f}" for x in r) + ")")
    return out


# --- padding ---------------------------------------------------------------------------------------------
def padding(args) -> dict:
    from transformers import AutoTokenizer

    from attnkit.corpus import read_corpus
    from attnkit.engine.forward import length_batches
    from attnkit.engine.plan import batches_of_window, plan_window, windows
    from attnkit.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    out = {}
    for path in args.files:
        segs = read_corpus(path, squad_pairs=args.squad_pairs)
        items = [s if isinstance(s, str) else list(s) for s in segs]
        lengths = [len(x) for x in tok(items, truncation=True, max_length=args.max_length)["input_ids"]]
        length_of = {id(s): n for s, n in zip(segs, lengths)}
        real = sum(lengths)

        def padded(window: int) -> int:
            total = 0
            for w in windows(segs, window):
                for b in batches_of_window(w, args.batch_size):
                    total += len(b) * max(length_of[id(s)] for s in b)
            return total

        def forwards(window: int) -> int:
            """What extraction runs: the units of the grouped plan, each cut by tokens (attnkit/engine/plan.py)."""
            total = 0
            for k, w in enumerate(windows(segs, window)):
                for pb in plan_window(w, args.batch_size, window_index=k, first_batch=0, start=0, grouped=True):
                    n = np.array([length_of[id(s)] for s in pb.segments])
                    for part in length_batches(n, args.batch_size) or [np.arange(len(n))]:
                        total += len(part) * int(n[part].max())
            return total

        glob = padded(len(segs))
        unsorted = sum(len(b) * max(length_of[id(s)] for s in b)
                       for b in (segs[i:i + args.batch_size] for i in range(0, len(segs), args.batch_size)))
        row = {"segments": len(segs), "real_tokens": real, "global": glob / real, "unsorted": unsorted / real}
        print(f"{path}: {len(segs)} segments, {real:,} tokens; padded/real: unsorted {unsorted / real:.3f}, "
              f"global sort {glob / real:.3f}")
        for w in args.windows:
            p = padded(w)
            row[f"window_{w}"] = p / real
            u = forwards(w)
            row[f"units_{w}"] = u / real
            print(f"  window {w:>6}: {p / real:.3f}  ({(p - glob) / glob:+.1%} vs global sort); the forwards of its "
                  f"units, cut by tokens: {u / real:.3f}")
        out[path] = row
    return out


# --- memory ----------------------------------------------------------------------------------------------
def tiny_model(path: Path, hidden: int = 64, layers: int = 2, heads: int = 4, intermediate: int = 128) -> Path:
    """A random BERT with MiniLM's tokenizer, saved to `path`."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from attnkit.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, intermediate_size=intermediate)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def memory(args) -> dict:
    scratch = tempfile.TemporaryDirectory(prefix="attnkit-bench-")  # removed on return or error
    tmp = Path(scratch.name)
    model = tiny_model(tmp / "tiny")
    out = {}
    for mb in args.sizes:
        corpus = tmp / f"corpus-{mb}mb.txt"
        with open(corpus, "w") as f:
            f.writelines(generated_lines(mb * 10**6, seed=mb))
        code = ("import resource, subprocess, sys, time; t=time.time(); "
                f"r=subprocess.run([sys.executable, '-m', 'attnkit.cli', 'extract', {str(corpus)!r}, '--model', "
                f"{str(model)!r}, '-o', {str(tmp / f'run-{mb}')!r}, '-q', '--max-length', '{args.max_length}', "
                f"'--batch-size', '64', '--workers', '{args.workers}']); "
                "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.time()-t)")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        rc, rss_kb, secs = res.stdout.split()[-3:]
        if rc != "0":
            sys.exit(res.stderr[-2000:])
        out[mb] = {"peak_rss_mb": int(rss_kb) / 1024, "seconds": float(secs)}
        print(f"{mb:>5} MB corpus: peak RSS {int(rss_kb) / 1024:,.0f} MB, {float(secs):,.0f} s")
        corpus.unlink()
    if len(out) >= 2:
        rss = [v["peak_rss_mb"] for v in out.values()]
        print(f"difference largest − smallest corpus: {max(rss) - min(rss):+.0f} MB")
    return out


# --- workers ---------------------------------------------------------------------------------------------
def _forward_seconds(model, batches, on_thread: bool) -> float:
    """Seconds for the forwards of `batches` on the calling (main) thread, or on a thread of their own."""
    import threading

    from attnkit.engine.forward import device_forward
    from attnkit.tokens import Batch

    out = {}

    def run():
        t0 = time.perf_counter()
        for arrays in batches:
            device_forward(model, Batch.from_arrays(arrays))
        out["s"] = time.perf_counter() - t0

    if on_thread:
        th = threading.Thread(target=run)
        th.start()
        th.join()
    else:
        run()
    return out["s"]


def workers(args) -> dict:
    """--workers 0 against --workers N with the tiny model of `memory`, and why: the same pre-tokenised forwards
    on the main thread and on a thread of their own, interleaved in one process; then `attnkit extract` end to
    end (a fresh process per run) with each source tree of --trees (e.g. the code before and after a change)."""
    import attnkit
    from attnkit.engine.forward import measuring
    from attnkit.engine.plan import plan_batches
    from attnkit.tokens import Encoder

    scratch = tempfile.TemporaryDirectory(prefix="attnkit-bench-")  # removed on return or error
    tmp = Path(scratch.name)
    model_dir = tiny_model(tmp / "tiny")
    corpus = tmp / "corpus.txt"
    with open(corpus, "w") as f:
        f.writelines(generated_lines(int(args.size_mb * 10**6), seed=3))
    model, tok = attnkit.load_model(str(model_dir), device="cpu")
    segs = [line.strip() for line in corpus.read_text().splitlines()[:args.segments]]
    encoder = Encoder(tok, max_length=args.max_length)
    batches = [encoder.encode_arrays(pb.segments) for pb in plan_batches(segs, args.batch_size, 4096)]
    times = {"main thread": [], "own thread": []}
    with measuring(model, backend="auto", num_windows=16):
        _forward_seconds(model, batches[:2], False)  # warm-up
        for _ in range(args.repeats):
            times["main thread"].append(_forward_seconds(model, batches, False))
            times["own thread"].append(_forward_seconds(model, batches, True))
    out = {"forward_s": {k: statistics.median(v) for k, v in times.items()}, "torch_threads": torch.get_num_threads(),
           "segments": len(segs)}
    print(f"forwards of {len(segs)} pre-tokenised segments ({len(batches)} batches, torch threads "
          f"{torch.get_num_threads()}), medians of {args.repeats}: "
          + "; ".join(f"{k} {statistics.median(v):.2f} s (runs {', '.join(f'{x:.2f}' for x in v)})"
                      for k, v in times.items()))
    trees = args.trees or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    wall = {(t, w): [] for t in trees for w in args.workers}
    for _ in range(args.repeats):
        for t in trees:
            for w in args.workers:
                run = tmp / "run"
                subprocess.run(["rm", "-rf", str(run)], check=True)
                env = dict(os.environ, PYTHONPATH=t)
                res = subprocess.run([sys.executable, "-m", "attnkit.cli", "extract", str(corpus), "--model",
                                      str(model_dir), "-o", str(run), "-q", "--batch-size", str(args.batch_size),
                                      "--max-length", str(args.max_length), "--workers", str(w)], env=env,
                                     check=True, capture_output=True, text=True)
                # the run's own time, from its last line ("measured N samples, ... in 12.3s ..."): start-up excluded
                wall[(t, w)].append(float(re.search(r" in ([0-9.]+)s", res.stdout).group(1)))
    out["extract_s"] = {f"{t} --workers {w}": statistics.median(v) for (t, w), v in wall.items()}
    print(f"attnkit extract, {args.size_mb} MB generated corpus ({sum(1 for _ in open(corpus))} lines), tiny model, "
          f"seconds the run reports (start-up excluded), medians of {args.repeats} (runs):")
    for t in trees:
        base = statistics.median(wall[(t, args.workers[-1])])
        for w in args.workers:
            med = statistics.median(wall[(t, w)])
            print(f"  {t}  --workers {w}: {med:6.1f} s  ({med / base:.2f}x --workers {args.workers[-1]})  ("
                  + ", ".join(f"{x:.1f}" for x in wall[(t, w)]) + ")")
    return out


# --- plan: the pipeline's own choice against fixed ones (issue 38) ------------------------------------------
def tiny_bert16(path: Path) -> Path:
    """A 1-layer random BERT with hidden size 16 (2 heads) and MiniLM's tokenizer: forwards so cheap that
    tokenising bounds a run."""
    return tiny_model(path, hidden=16, layers=1, heads=2, intermediate=64)


def _alone(model_dir: Path, corpus: Path, batch_size: int, max_length: int) -> tuple[float, float]:
    """(seconds tokenising the corpus on this thread alone, the Rust tokenizer's own threads off as in a run on the
    CPU, seconds of the forwards a run makes of it, pre-tokenised): the units of the plan, each tokenised as one
    and run in forwards cut by tokens, as `attnkit extract` does (attnkit/engine/plan.py)."""
    import attnkit
    from attnkit.engine.forward import device_forward, measuring, unit_features
    from attnkit.engine.local import tokenizer_threads_off
    from attnkit.engine.plan import plan_batches
    from attnkit.tokens import Encoder

    model, tok = attnkit.load_model(str(model_dir), device="cpu")
    segs = [ln for ln in corpus.read_text().splitlines() if ln.strip()]
    enc = Encoder(tok, max_length=max_length)
    planned = list(plan_batches(segs, batch_size, 4096, grouped=True))
    with tokenizer_threads_off():
        t = time.perf_counter()
        arrays = [enc.encode_arrays(pb.segments) for pb in planned]
        tokenise = time.perf_counter() - t

    def run(a):
        return unit_features(device_forward, model, a, batch_size, lambda b: b)

    with measuring(model):
        run(arrays[0])
        t = time.perf_counter()
        for a in arrays:
            run(a)
        forward = time.perf_counter() - t
    return tokenise, forward


PLAN_CASES = ("tokenise-bound", "forward-bound")


def plan(args) -> dict:
    return measure_plan(args.plan_size_mb, args.stsb, args.configs, args.repeats, args.max_length, args.plan_cases)


def measure_plan(plan_size_mb: float, stsb: str, fixed: list[str], repeats: int, max_length: int = 128,
                 which=PLAN_CASES) -> dict:
    """`plan` (the module docstring) on the cases of `which`: the default options against the `fixed`
    workers/threads. Returns {case: {"seconds": {config: median s}, "default_over_best_fixed", "choice", and for
    the tokenise-bound case "tokenise_s", "forward_s", "limit_s", "share_of_limit"}}."""
    import csv

    scratch = tempfile.TemporaryDirectory(prefix="attnkit-plan-")  # removed on return or error
    tmp = Path(scratch.name)
    cases = {}
    if "tokenise-bound" in which:
        tiny = tiny_bert16(tmp / "bert16")
        gen = tmp / "generated.txt"
        with open(gen, "w") as f:
            f.writelines(generated_lines(int(plan_size_mb * 10**6), seed=5))
        cases["tokenise-bound"] = (tiny, gen)
    if "forward-bound" in which and Path(stsb).exists():
        with open(stsb, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        sts = tmp / "stsb.txt"
        sts.write_text("\n".join(r[c] for r in rows for c in ("sentence1", "sentence2")) + "\n")
        from attnkit.models import default_model_path

        cases["forward-bound"] = (Path(default_model_path()), sts)
    elif "forward-bound" in which:
        print(f"no {stsb}: the forward-bound case is left out")
    configs = ["default"] + list(fixed)
    times = {(c, k): [] for c in cases for k in configs}
    lines = {}
    limits = {}
    for r in range(repeats):
        for case, (model_dir, corpus) in cases.items():
            if case == "tokenise-bound":
                tok_s, fwd_s = _alone(model_dir, corpus, 16, max_length)
                limits.setdefault(case, []).append((tok_s, fwd_s))
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for k in order:
                run = tmp / "run"
                subprocess.run(["rm", "-rf", str(run)], check=True)
                extra = [] if k == "default" else ["--workers", k.split("/")[0], "--threads", k.split("/")[1]]
                res = subprocess.run([sys.executable, "-m", "attnkit.cli", "extract", str(corpus), "--model",
                                      str(model_dir), "-o", str(run), "--max-length", str(max_length), *extra],
                                     env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
                                     check=True, capture_output=True, text=True)
                times[(case, k)].append(float(re.search(r" in ([0-9.]+)s", res.stdout).group(1)))
                if k == "default":
                    lines.setdefault(case, [ln for ln in res.stderr.splitlines() if ln.startswith("pipeline:")][0])
            print(f"  round {r + 1} {case}: " + ", ".join(f"{k} {times[(case, k)][-1]:.2f} s" for k in configs)
                  + f" ({os.getloadavg()[0]:.2f} load)", flush=True)
    out = {}
    print(f"medians of {repeats} (load {' '.join(f'{x:.2f}' for x in os.getloadavg())}), configurations "
          "workers/threads:")
    for case in cases:
        med = {k: statistics.median(times[(case, k)]) for k in configs}
        best = min(v for k, v in med.items() if k != "default")
        print(f"  {case}: {lines.get(case, '')}")
        print("    " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items())
              + f"; default / best fixed = {med['default'] / best:.2f}")
        out[case] = {"seconds": med, "default_over_best_fixed": med["default"] / best, "choice": lines.get(case)}
        if case in limits:
            tok_s = statistics.median(t for t, _ in limits[case])
            fwd_s = statistics.median(f for _, f in limits[case])
            limit = (tok_s + fwd_s) / 2
            print(f"    tokenising alone {tok_s:.2f} s, forwards alone {fwd_s:.2f} s: 2-core limit {limit:.2f} s; "
                  f"default reaches {limit / med['default']:.2f} of it")
            out[case].update(tokenise_s=tok_s, forward_s=fwd_s, limit_s=limit, share_of_limit=limit / med["default"])
    return out


# --- spike: a neighbour busy for the first seconds only (issue 46) -------------------------------------------
NEIGHBOUR = """
import sys, time, torch
torch.set_num_threads(2)
a = torch.randn(384, 384)
print("ready", flush=True)
sys.stdin.readline()
t = time.perf_counter()
while time.perf_counter() - t < float(sys.argv[1]):
    a @ a
"""


def _extract(corpus: Path, model_dir: Path, run: Path, max_length: int, resume: bool = False,
             spike: float | None = None, stop_after: float | None = None) -> tuple[float | None, dict | None]:
    """One `attnkit extract` (default options) in a fresh process: (the seconds it reports, meta.json's `pipeline`).
    `spike`: a 2-thread torch neighbour busy for that many seconds from the run's "attnkit extract:" line (model
    loaded, the plan about to be measured); `stop_after`: SIGINT that many seconds after the line (a checkpoint)."""
    import signal
    import threading

    neighbour = None
    if spike:
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(spike)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        neighbour.stdout.readline()  # torch loaded: it starts the moment it is told
    cmd = [sys.executable, "-m", "attnkit.cli", "extract", str(corpus), "--model", str(model_dir), "-o", str(run),
           "--max-length", str(max_length)] + (["--resume"] if resume else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    timer = None
    for line in proc.stderr:
        if line.startswith("attnkit extract:"):
            if neighbour is not None:
                neighbour.stdin.write("go\n")
                neighbour.stdin.flush()
            if stop_after is not None:
                timer = threading.Timer(stop_after, proc.send_signal, [signal.SIGINT])
                timer.start()
            break
    out, err = proc.communicate()
    if timer is not None:
        timer.cancel()
    if neighbour is not None:
        neighbour.stdin.close()
        neighbour.wait()
    if stop_after is not None:
        if proc.returncode != 130:
            raise SystemExit(f"the run to interrupt ended with {proc.returncode} (--stop-share too late?): "
                             f"{err[-500:]}")
        return None, None
    if proc.returncode != 0:
        raise SystemExit(f"attnkit extract failed ({proc.returncode}): {err[-2000:]}")
    seconds = float(re.search(r" in ([0-9.]+)s", out).group(1))
    return seconds, json.loads((run / "meta.json").read_text()).get("pipeline")


def _plan_story(pipeline: dict | None) -> str:
    """workers/threads chosen, and each change of plan with its second."""
    if not pipeline:
        return "?"
    text = f"{pipeline['workers']}/{pipeline['threads']}"
    if pipeline.get("replans"):
        first = pipeline["initial"]
        text = f"{first['workers']}/{first['threads']} -> " + " -> ".join(
            f"{r['workers']}/{r['threads']} ({r['seconds']:.1f} s)" for r in pipeline["replans"])
    return text


def spike(args) -> dict:
    import shutil

    scratch = tempfile.TemporaryDirectory(prefix="attnkit-spike-")  # removed on return or error
    tmp = Path(scratch.name)
    model_dir = tiny_bert16(tmp / "bert16")
    corpus = tmp / "generated.txt"
    with open(corpus, "w") as f:
        f.writelines(generated_lines(int(args.plan_size_mb * 10**6), seed=5))
    ml = args.max_length
    cases = ("quiet", "neighbour", "resume quiet", "resume spike")
    times: dict = {k: [] for k in cases}
    plans: dict = {k: [] for k in cases}
    for r in range(args.repeats):
        order = [("quiet", None), ("neighbour", args.spike_seconds)]
        for name, busy in (order if r % 2 == 0 else order[::-1]):
            shutil.rmtree(tmp / "run", ignore_errors=True)
            s, p = _extract(corpus, model_dir, tmp / "run", ml, spike=busy)
            times[name].append(s)
            plans[name].append(_plan_story(p))
        shutil.rmtree(tmp / "stopped", ignore_errors=True)
        _extract(corpus, model_dir, tmp / "stopped", ml, stop_after=args.stop_share * times["quiet"][-1])
        order = [("resume quiet", None), ("resume spike", args.spike_seconds)]
        for name, busy in (order if r % 2 == 0 else order[::-1]):
            shutil.rmtree(tmp / "run", ignore_errors=True)
            shutil.copytree(tmp / "stopped", tmp / "run")
            s, p = _extract(corpus, model_dir, tmp / "run", ml, resume=True, spike=busy)
            times[name].append(s)
            plans[name].append(_plan_story(p))
        print(f"  round {r + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f} s ({plans[k][-1]})" for k in cases)
              + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"seconds": med, "plans": plans, "neighbour_over_quiet": med["neighbour"] / med["quiet"],
           "resume_spike_over_quiet": med["resume spike"] / med["resume quiet"]}
    print(f"medians of {args.repeats} ({args.plan_size_mb} MB, neighbour busy {args.spike_seconds} s; load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}): " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()))
    print(f"  beside the neighbour / quiet: {out['neighbour_over_quiet']:.2f}; resume under it / quiet resume: "
          f"{out['resume_spike_over_quiet']:.2f} (the bar: 1.3)")
    return out


# --- ray -------------------------------------------------------------------------------------------------
def ray_vs_local(args) -> dict:
    scratch = tempfile.TemporaryDirectory(prefix="attnkit-bench-")  # removed on return or error
    tmp = Path(scratch.name)
    corpus = Path(args.corpus) if args.corpus else tmp / "corpus.txt"
    if not args.corpus:
        with open(corpus, "w") as f:
            f.writelines(line for _, line in zip(range(args.segments), generated_lines(10**9)))
    out = {}
    for engine in ("local", "ray", "local"):
        t0 = time.perf_counter()
        run = tmp / f"run-{engine}-{len(out)}"
        res = subprocess.run([sys.executable, "-m", "attnkit.cli", "extract", str(corpus), "-o", str(run), "-q",
                              "--engine", engine, "--max-length", str(args.max_length)], capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-2000:])
        meta = json.loads((run / "meta.json").read_text())
        secs = time.perf_counter() - t0
        out.setdefault(engine, []).append(meta["n_tokens"] / secs)
        print(f"{engine:>6}: {meta['n_tokens'] / secs:,.0f} tok/s end to end ({secs:.1f} s, process start included)")
    return out


# --- gpu -------------------------------------------------------------------------------------------------
def gpu(args) -> dict:
    from transformers import AutoTokenizer, BertConfig, BertModel

    import attnkit
    from attnkit.engine import ExtractSettings, run_extraction
    from attnkit.engine.plan import plan_batches
    from attnkit.models import default_model_path
    from attnkit.tokens import Encoder

    # --dry-run: the same script on the CPU with a tiny model (tools/gpu_check.sh --dry-run)
    dev = "cpu" if args.dry_run else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu: no CUDA device")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if dev == "cpu":
        dtype = torch.float32
    tok = AutoTokenizer.from_pretrained(default_model_path())
    segments = corpus_segments(args.corpus, args.segments)
    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    cfg = BertConfig(vocab_size=tok.vocab_size, **(small if args.dry_run else {}))
    sdpa = BertModel(cfg).to(dev, dtype).eval()
    sdpa.set_attn_implementation("sdpa")
    fused = BertModel(cfg).to(dev, dtype).eval()
    fused.load_state_dict(sdpa.state_dict())
    attnkit.instrument(fused)
    enc = Encoder(tok, max_length=args.max_length)
    batches = [enc(pb.segments).to(dev) for pb in plan_batches(segments, args.batch_size, 4096)]
    n_tokens = sum(b.n_tokens for b in batches)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def plain() -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in batches:
                sdpa(**b.inputs)
        sync()
        return n_tokens / (time.perf_counter() - t0)

    def extraction() -> float:
        t0 = time.perf_counter()
        acc = run_extraction(fused, tok, segments, ExtractSettings(batch_size=args.batch_size,
                                                                   max_length=args.max_length),
                             workers=args.workers[-1]).accumulator
        return acc.n_tokens / (time.perf_counter() - t0)

    plain(), extraction()  # warm-up
    p, e = [], []
    for _ in range(args.repeats):
        p.append(plain())
        e.append(extraction())
    mp, me = statistics.median(p), statistics.median(e)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)"
    print(f"{name}: plain sdpa forward {mp:,.0f} tok/s (pre-tokenised, on device); attnkit "
          f"extraction end to end {me:,.0f} tok/s = {me / mp:.2f}x")
    return {"device": name, "segments": len(segments), "plain_sdpa_tok_s": mp, "extraction_tok_s": me, "ratio": me / mp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["overlap", "padding", "memory", "ray", "gpu", "workers", "plan", "spike"])
    ap.add_argument("files", nargs="*", help="padding: corpus files")
    ap.add_argument("--corpus", default=None, help="a corpus file (default: generated English-like lines)")
    ap.add_argument("--segments", type=int, default=40000)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--windows", default="64,256,1024,4096", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--squad-pairs", action="store_true")
    ap.add_argument("--sizes", default="50,500", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--dry-run", action="store_true", help="gpu: run on the CPU with a tiny model (checks the script)")
    ap.add_argument("--size-mb", type=float, default=1.0, help="workers: size of the generated corpus")
    ap.add_argument("--trees", default=None, type=lambda s: s.split(","),
                    help="workers: source trees to run `attnkit extract` from (PYTHONPATH), e.g. before,after")
    ap.add_argument("--plan-size-mb", type=float, default=8.0, help="plan: the tokenise-bound corpus")
    ap.add_argument("--configs", default="0/2,1/1,1/2,2/1,2/2", type=lambda s: s.split(","),
                    help="plan: fixed workers/threads to compare with the default")
    ap.add_argument("--plan-cases", default=",".join(PLAN_CASES), type=lambda s: s.split(","),
                    help="plan: which cases (tokenise-bound, forward-bound)")
    ap.add_argument("--stsb", default=str(Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "stsb"
                                          / "dev.tsv"), help="plan: STS-B dev (the forward-bound case)")
    ap.add_argument("--spike-seconds", type=float, default=4.0, help="spike: how long the neighbour is busy")
    ap.add_argument("--stop-share", type=float, default=0.11,
                    help="spike: where the run to resume is interrupted, as a share of the quiet run's seconds")
    args = ap.parse_args()
    if args.what == "memory":
        args.workers = args.workers[-1]
    what = {"overlap": overlap, "padding": padding, "memory": memory, "ray": ray_vs_local, "gpu": gpu,
            "workers": workers, "plan": plan, "spike": spike}
    result = what[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
