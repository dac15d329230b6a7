"""Benchmark: long inputs on the embedded decoder SmolLM2-135M-Instruct (issue 26; docs/decoders.md).

    python bench/long.py                                   # L = 1k, 2k, 4k, 8k; 3 rounds
    python bench/long.py --lengths 4096 --rounds 3 --json long.json

For each length L, one sample of L tokens of real English (the built-in corpus, repeated), batch 1, fp32, on
the CPU with `--threads` threads (default 2):
  sdpa      the plain forward, transformers' sdpa attention (no statistics), without a KV cache (as extraction
            runs it: `use_cache=False`; a decoder otherwise keeps 46 KB per token that nobody reads)
  attnkit   attnkit extraction: the instrumented model under `measuring` (attnkit.engine.forward_features), the
            features of every head; the backend attnkit picks (`--backend`)
  eager     eager attention with output_attentions=True (the maps of every layer: 30 × 9 × L × L floats)
and attnkit's extraction with another allocator under c10's (`--configs`; docs/process.md, "Memory on the CPU"):
  attnkit-jemalloc  c10's allocator over jemalloc (LD_PRELOAD of Debian's libjemalloc2)
  attnkit-mimalloc  c10's allocator over mimalloc (LD_PRELOAD of Debian's libmimalloc2.0)
A preloaded allocator that is not installed is skipped, and the table says so.
Each (configuration, L, round) runs in a fresh process: it loads the model, warms up on 64 tokens, resets the
peak RSS (/proc/self/clear_refs), times one forward and reads the peak (VmHWM). Reported: tokens/s and the peak
RSS of the process (model included) and its rise over the forward ("Δ"), medians over `--rounds` rounds, the
rounds interleaved (sdpa, attnkit, eager, sdpa, ...).

`--same-process` runs every configuration's model in one fresh process instead and interleaves their forwards
(sdpa, attnkit, attnkit, sdpa, ...): tokens/s and the paired ratio of each round, without what differs between fresh
processes (beside another busy process, fresh processes' 4k forwards fall into a fast and a slow mode, 150-158
against 170-190 tok/s, for sdpa and attnkit alike: libgomp's threads spinning at barriers, which
OMP_WAIT_POLICY=PASSIVE removes; a median of a few fresh rounds draws its modes by chance; bench/README.md). It
reports no peak memory (the models share the process), and runs no preloaded allocator.

    python bench/long.py --lengths 4096 --configs sdpa,attnkit --rounds 6 --same-process

Guard: a configuration whose estimated peak exceeds `--memory-share` (default 0.6) of MemAvailable at the
start is not run, and the table says so with the estimate (eager: every layer's maps, B·layers·H·L²·4 bytes,
plus one layer's scores and softmax; attnkit on the reference backend: about 8 L × L float tensors per layer).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

try:
    import attnkit  # noqa: F401
except ImportError:  # run from a source checkout: python bench/long.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extract import rss_kb  # noqa: E402  (bench/extract.py: a field of /proc/self/status)

CONFIGS = ("sdpa", "attnkit", "eager")
# attnkit's extraction under another allocator: the environment of its process (docs/process.md)
ALLOCATORS = {
    "attnkit-jemalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    "attnkit-mimalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"},
}
LAYERS, HEADS = 30, 9  # SmolLM2-135M


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def estimate_bytes(config: str, L: int, backend: str) -> int:
    """A rough upper estimate of what the forward adds at length L (see the module docstring)."""
    if config == "eager":
        return LAYERS * HEADS * L * L * 4 + 3 * HEADS * L * L * 4
    if config.startswith("attnkit") and backend == "reference":
        return 8 * HEADS * L * L * 4
    return 64 * L * 576 * 4 * 4  # activations, linear in L


def inputs(tokenizer, L: int):
    """A Batch of one sample of L tokens (the built-in corpus repeated) with attnkit's token classes."""
    import torch

    from attnkit.corpus import default_corpus_path
    from attnkit.tokens import Batch, Encoder

    ids = tokenizer(default_corpus_path().read_text(encoding="utf-8"))["input_ids"]
    ids = (ids * (L // len(ids) + 1))[:L]
    t = torch.tensor([ids])
    enc = Encoder(tokenizer, max_length=max(L, 2))
    cls = torch.from_numpy(enc.token_classes(t.numpy()))
    return Batch({"input_ids": t, "attention_mask": torch.ones_like(t)}, torch.tensor([L]), cls,
                 torch.zeros_like(t, dtype=torch.int32), 0)


def build(config: str, backend: str):
    """The model of `config` and its forward: returns (run(batch), tokenizer)."""
    import torch
    from transformers import AutoModel

    import attnkit
    from attnkit.engine.forward import forward_features, measuring, no_cache
    from attnkit.models import model_dir

    if config.startswith("attnkit"):
        model, tok = attnkit.load_model("smollm2", device="cpu")
    else:
        tok = attnkit.load_model("smollm2", device="cpu")[1]  # converts the copy if needed; the model is freed
        model = AutoModel.from_pretrained(model_dir("smollm2"), attn_implementation=config).eval()

    def run(batch):
        with torch.inference_mode():
            if config.startswith("attnkit"):
                with measuring(model, backend=backend):
                    return forward_features(model, batch)
            out = model(**batch.inputs, **no_cache(model), output_attentions=config == "eager")
            return out.last_hidden_state

    run(inputs(tok, 64))  # warm-up
    return run, tok


def child(config: str, L: int, threads: int, backend: str) -> dict:
    """One measurement in this (fresh) process."""
    import torch

    import attnkit

    torch.set_num_threads(threads)
    run, tok = build(config, backend)
    batch = inputs(tok, L)
    before = rss_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    t0 = time.perf_counter()
    run(batch)
    seconds = time.perf_counter() - t0
    peak = rss_kb("VmHWM")
    return {"config": config, "L": L, "seconds": seconds, "tokens_per_s": L / seconds, "peak_mb": peak / 1024,
            "delta_mb": max(0, peak - before) / 1024, "backend": attnkit.backend_info()}


def same_process(lengths, configs, rounds: int, threads: int, backend: str) -> dict:
    """Every configuration's model in this one process, their forwards interleaved per length and round (the
    order reversed every other round): the speed without what differs between fresh processes. Returns
    {"runs": [...], "medians": [{"L", "config", "tokens_per_s"}], "paired": [{"L", "config", "ratios"}]}."""
    import torch

    torch.set_num_threads(threads)
    models = {config: build(config, backend) for config in configs}
    batches = {L: inputs(models[configs[0]][1], L) for L in lengths}
    runs = []
    for r in range(rounds):
        for L in lengths:
            for config in (configs if r % 2 == 0 else configs[::-1]):
                t0 = time.perf_counter()
                models[config][0](batches[L])
                seconds = time.perf_counter() - t0
                runs.append({"config": config, "L": L, "round": r, "seconds": seconds, "tokens_per_s": L / seconds})
                print(f"round {r} {config:8s} L={L:5d}: {L / seconds:8.1f} tok/s", flush=True)
    print("\nmedians (one process; no peak memory: the models share it)")
    print(f"{'L':>6} {'config':8} {'tok/s':>9} {'min':>8} {'max':>8} {'vs sdpa':>8} {'paired vs sdpa (per round)':>28}")
    medians, paired = [], []
    for L in lengths:
        speed = {c: [x["tokens_per_s"] for x in runs if x["config"] == c and x["L"] == L] for c in configs}
        for c in configs:
            m = statistics.median(speed[c])
            medians.append({"L": L, "config": c, "tokens_per_s": m})
            line = f"{L:6d} {c:8} {m:9.1f} {min(speed[c]):8.1f} {max(speed[c]):8.1f}"
            if "sdpa" in speed:
                ratios = [a / b for a, b in zip(speed[c], speed["sdpa"])]
                paired.append({"L": L, "config": c, "ratios": ratios})
                line += (f" {m / statistics.median(speed['sdpa']):8.2f}  median {statistics.median(ratios):.2f} of "
                         + " ".join(f"{x:.2f}" for x in ratios))
            print(line)
    return {"runs": runs, "medians": medians, "paired": paired, "same_process": True}


def measure(lengths, configs=CONFIGS, rounds: int = 3, threads: int = 2, backend: str = "auto",
            memory_share: float = 0.6) -> dict:
    """The rounds of the module docstring, each (configuration, L, round) in a fresh process, printing every run and
    the medians. Returns {"runs": [...], "medians": [{"L", "config", "tokens_per_s", "peak_mb", "delta_mb"}],
    "decoder_backend", "skipped": [...]}."""
    from attnkit.ops import resolve_backend

    op_backend = resolve_backend(backend, "cpu")
    # decoder arguments (causal, GQA) run on the reference until the compiled op takes them (attnkit.ops)
    try:
        import torch

        from attnkit.ops import attention

        q = torch.zeros(1, 2, 4, 8)
        attention(q, q[:, :1], q[:, :1], torch.tensor([4]), causal=True, backend="fused")
        decoder_backend = op_backend
    except Exception:
        decoder_backend = "reference"
    avail = mem_available_bytes()
    print(f"SmolLM2-135M, fp32, {threads} threads, batch 1; MemAvailable {avail / 2**30:.1f} GiB; attnkit's "
          f"decoder backend: {decoder_backend}", flush=True)
    results, skipped = [], {}
    for r in range(rounds):
        for L in lengths:
            for config in configs:
                need = estimate_bytes(config, L, decoder_backend)
                if need > memory_share * avail:
                    skipped[(config, L)] = f"estimated {need / 2**30:.1f} GiB > {memory_share:.0%} of MemAvailable"
                    continue
                env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                           **ALLOCATORS.get(config, {}))
                if not os.path.exists(env.get("LD_PRELOAD", os.devnull)):
                    skipped[(config, L)] = f"{env['LD_PRELOAD']} is not installed"
                    continue
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{config}:{L}",
                                       "--threads", str(threads), "--backend", backend],
                                      capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                    print(f"round {r} {config} L={L}: failed (exit {proc.returncode}): {tail}", flush=True)
                    results.append({"config": config, "L": L, "failed": tail, "exit": proc.returncode})
                    continue
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                res["round"] = r
                results.append(res)
                print(f"round {r} {config:8s} L={L:5d}: {res['tokens_per_s']:8.1f} tok/s, peak "
                      f"{res['peak_mb']:8.0f} MB (forward Δ {res['delta_mb']:7.0f} MB)", flush=True)
    print("\nmedians")
    print(f"{'L':>6} {'config':8} {'tok/s':>9} {'peak MB':>9} {'Δ MB':>8} {'tok/s vs sdpa':>14} {'peak vs sdpa':>13}")
    table = []
    for L in lengths:
        row = {}
        for config in configs:
            ok = [x for x in results if x["config"] == config and x["L"] == L and "failed" not in x]
            if ok:
                row[config] = {k: statistics.median(x[k] for x in ok) for k in ("tokens_per_s", "peak_mb", "delta_mb")}
        for config in configs:
            if (config, L) in skipped:
                print(f"{L:6d} {config:8} skipped: {skipped[(config, L)]}")
                continue
            if config not in row:
                print(f"{L:6d} {config:8} failed (out of memory?)")
                continue
            m, base = row[config], row.get("sdpa")
            rel = (f"{m['tokens_per_s'] / base['tokens_per_s']:14.2f} {m['peak_mb'] / base['peak_mb']:13.2f}"
                   if base else "")
            print(f"{L:6d} {config:8} {m['tokens_per_s']:9.1f} {m['peak_mb']:9.0f} {m['delta_mb']:8.0f} {rel}")
            table.append({"L": L, "config": config, **m})
    return {"runs": results, "medians": table, "decoder_backend": decoder_backend,
            "skipped": [{"config": c, "L": L, "why": why} for (c, L), why in skipped.items()]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="auto", help="attnkit's backend (auto, fused, reference)")
    p.add_argument("--memory-share", type=float, default=0.6)
    p.add_argument("--json", default=None)
    p.add_argument("--same-process", action="store_true",
                   help="every configuration's model in one fresh process, forwards interleaved: speeds and paired "
                        "ratios without the variation between processes; no peak memory (not with the "
                        "preloaded-allocator configurations)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        config, L = a.child.split(":")
        print(json.dumps(child(config, int(L), a.threads, a.backend)))
        return 0
    lengths, configs = [int(x) for x in a.lengths.split(",")], [c for c in a.configs.split(",") if c]
    if a.same_process:
        preloaded = [c for c in configs if c in ALLOCATORS]
        if preloaded:
            p.error(f"--same-process cannot run {', '.join(preloaded)}: a preloaded allocator needs a process of "
                    "its own")
        env_threads = {"OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
        if any(os.environ.get(k) != v for k, v in env_threads.items()):  # libgomp reads them at start: a fresh process
            os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])],
                      dict(os.environ, **env_threads))
        print(f"SmolLM2-135M, fp32, {a.threads} threads, batch 1, one process", flush=True)
        out = same_process(lengths, configs, a.rounds, a.threads, a.backend)
    else:
        out = measure(lengths, configs, a.rounds, a.threads, a.backend, a.memory_share)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
