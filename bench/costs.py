"""Benchmark: what per-head statistics cost next to a plain forward, every case of issue 38's table in one run.

    python bench/costs.py --stsb ../shared/data/stsb/dev.tsv      # every row (an hour or more on 2 busy cores)
    python bench/costs.py --only short,minilm --json costs.json   # a subset, the table saved
    python bench/costs.py --quick                                 # smoke-sized: checks the script, not the targets

Each row is measured by the bench that owns it, called as a function in this process (its own interleaving:
medians of interleaved repeats, as that bench's command line runs it), one row after another:

  short    bench/short.py: `attnkit.extract` on 1,000 sentences of about 15 tokens (STS-B dev, --stsb; held-out
           sentences of the built-in corpus without it), MiniLM, batches of 16, tokenisation inside every timing,
           against a naive script (eager + output_attentions) and the sdpa forward of the same sorted batches
  minilm   bench/cpu_capability.py minilm: MiniLM B=16 L=128, extraction (the best build this CPU runs) against the
           plain sdpa forward
  lengths  bench/cpu_capability.py lengths: the op with features against sdpa (ATen's CPU flash kernel) at
           SmolLM2's shapes, causal GQA and bidirectional, L = 128 ... 8192, 10% special tokens
  plan     bench/pipeline.py plan: `attnkit extract` with default options against fixed workers/threads, on an
           8 MB tokenise-bound corpus (against the 2-core limit) and on MiniLM over STS-B dev (forward-bound)
  long     bench/long.py: SmolLM2-135M at L = 4096 and 8192, extraction tokens/s and peak RSS against the sdpa
           forward (a fresh process per run)
  busy     bench/regimes.py: extract on short texts, detect-heads and ablate, each in a fresh process per wait
           regime (attnkit's own choice, libgomp's default, PASSIVE), on the machine as it is and beside a 2-thread
           torch process

At the end one table: case | what it measures | measured (and the command that reproduces it) | target | met? |
load (`uptime`) before → after the row, headed by the CPU (`lscpu`), torch, its threads and how they wait. The
machine may be shared: only ratios within a row mean anything, and the load says how busy it was. --quick shrinks
every row to seconds (tiny sizes, one round); its "met?" column says n/a. --repeats N runs N rounds in every row
instead of its own (short 5, minilm 3, lengths 5, plan 3, long 3, busy 1). --json PATH writes the table.
A row that fails says why in its line, the others still run, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# this checkout's attnkit, here and in every process a row starts (not another copy installed in the environment)
sys.path[:0] = [str(BENCH), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

from attnkit.engine.openmp import configure  # noqa: E402

REGIME = configure()  # before torch loads, as every command decides it; the benches below run in this regime

import torch  # noqa: E402
from regimes import STSB  # noqa: E402  (bench/regimes.py; imports nothing heavy)

ROWS = ("short", "minilm", "lengths", "plan", "long", "busy")


def cpu_name() -> str:
    """lscpu's model name (/proc/cpuinfo's where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), None)
        if name:
            return name
    except (OSError, subprocess.SubprocessError):
        pass
    from short import cpu_model  # bench/short.py

    return cpu_model()


def load() -> str:
    """The load averages as `uptime` prints them (1, 5, 15 minutes)."""
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout
        return out.split("load average:")[1].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def line(case: str, what: str, measured: str, command: str, target: str, met, figures: dict) -> dict:
    return {"case": case, "what": what, "measured": measured, "command": command, "target": target, "met": met,
            "figures": figures}


# --- the rows: each returns its table lines --------------------------------------------------------------------
def row_short(o: argparse.Namespace) -> list[dict]:
    import short

    quick, stsb = o.quick, o.stsb
    kind = "stsb" if stsb.exists() and not quick else "held-out"
    if kind == "held-out" and not quick:
        print(f"no {stsb}: held-out sentences of the built-in corpus instead")
    n, repeats, configs = (48, 1, "sdpa,naive,extract") if quick else (1000, o.repeats or 5, "sdpa,naive,extract")
    res = short.measure(short.texts_for(kind, stsb, n), kind, 16, repeats, configs.split(","))
    w, c = res["wall"], res["cpu"]
    naive, sdpa = w["extract"] / w["naive"], w["extract"] / w["sdpa"]
    return [line(
        "short texts", f"`attnkit.extract` on {res['n_texts']} {kind} texts ({res['n_tokens'] / res['n_texts']:.1f} "
        "tokens each), MiniLM, batches of 16, tokenisation inside every timing, interleaved medians: against a "
        "length-sorted naive script (eager + `output_attentions`) and the sdpa forward of the same sorted batches",
        f"{naive:.2f}× naive, {sdpa:.2f}× sdpa (extract {w['extract']:.2f} s, naive {w['naive']:.2f} s, sdpa "
        f"{w['sdpa']:.2f} s; CPU time {c['extract'] / c['naive']:.2f}×, {c['extract'] / c['sdpa']:.2f}×)",
        f"python bench/short.py --texts {kind} --stsb {stsb} --n {n} --batch 16 --repeats {repeats} "
        f"--configs {configs}",
        "≤ 0.9× naive, ≤ 1.05× sdpa", naive <= 0.9 and sdpa <= 1.05, res)]


def row_minilm(o: argparse.Namespace) -> list[dict]:
    import cpu_capability

    from attnkit import ops

    best = ops.cpu_capabilities()[0]
    rounds = 1 if o.quick else o.repeats or 3
    res = cpu_capability.minilm(rounds, [best])
    (ws, cs), (we, ce) = res["plain-sdpa"], res[f"extract {best}"]
    return [line(
        "MiniLM at L=128", f"fused extraction / sdpa forward (speed), B=16, the {best} build, interleaved medians",
        f"{ws / we:.2f} (extract {we * 1e3:.0f} ms, sdpa {ws * 1e3:.0f} ms per batch; in CPU time {cs / ce:.2f})",
        f"python bench/cpu_capability.py --only minilm --rounds {2 * rounds}",
        "≥ 1.0", ws / we >= 1.0, {k: {"wall_s": v[0], "cpu_s": v[1]} for k, v in res.items()})]


def row_lengths(o: argparse.Namespace) -> list[dict]:
    import cpu_capability

    lens, rounds, budget = ([128, 256], 1, 1.0) if o.quick else ([128, 512, 2048, 4096, 8192], o.repeats or 5, 8.0)
    summary = cpu_capability.lengths(lens, rounds, budget)
    worst, worst_cpu = max(summary, key=lambda s: s[2]), max(summary, key=lambda s: s[3])
    cells = "; ".join(f"{L} {mask} {w:.2f}" for L, mask, w, _ in summary)
    return [line(
        "the kernel against sdpa", "the op with statistics / sdpa (ATen's CPU flash kernel), time, SmolLM2's shapes "
        "(B=1, H=9, Hkv=3, D=64), causal GQA and bidirectional, 10% special tokens, interleaved medians",
        f"{cells} (worst {worst[2]:.2f} at {worst[0]} {worst[1]}; in CPU time {worst_cpu[3]:.2f} at {worst_cpu[0]} "
        f"{worst_cpu[1]})",
        f"python bench/cpu_capability.py --only lengths --lengths {' '.join(map(str, lens))} --rounds {rounds} "
        f"--budget {budget:g}",
        "≤ 1.1× at every length", worst[2] <= 1.1,
        {"rows": [{"L": L, "mask": m, "wall_over_sdpa": w, "cpu_over_sdpa": c} for L, m, w, c in summary]})]


def row_plan(o: argparse.Namespace) -> list[dict]:
    import pipeline

    quick, stsb = o.quick, o.stsb
    if quick:
        size, fixed, repeats, which = 0.2, ["2/1"], 1, ["tokenise-bound"]
    else:
        size, fixed, repeats = 8.0, ["0/2", "1/1", "1/2", "2/1", "2/2"], o.repeats or 3
        which = list(pipeline.PLAN_CASES)
    res = pipeline.measure_plan(size, str(stsb), fixed, repeats, 128, which)
    cmd = (f"python bench/pipeline.py plan --plan-size-mb {size:g} --configs {','.join(fixed)} --repeats {repeats} "
           f"--plan-cases {','.join(which)} --stsb {stsb}")
    out = []
    for case in which:
        if case not in res:
            out.append(line(case, "`attnkit extract`, default options", f"not run: no {stsb}", cmd,
                            "≤ 1.25× the best fixed", None, {}))
            continue
        r = res[case]
        sec = r["seconds"]
        best = min((k for k in sec if k != "default"), key=sec.get)
        choice = "chose " + (r.get("choice") or "?").split(" (measured")[0].removeprefix("pipeline: ")
        over = r["default_over_best_fixed"]
        if case == "tokenise-bound":
            out.append(line(
                "tokenise-bound corpus", f"`attnkit extract` with default options on {size:g} MB of generated "
                "lines, 1-layer BERT with hidden size 16, against the 2-core limit ((tokenising alone + forwards "
                "alone) / 2) and fixed workers/threads, fresh processes, interleaved medians",
                f"{sec['default']:.2f} s = {r['share_of_limit']:.2f} of the limit {r['limit_s']:.2f} s (tokenising "
                f"{r['tokenise_s']:.2f} s, forwards {r['forward_s']:.2f} s alone); {over:.2f}× the best fixed "
                f"({best}: {sec[best]:.2f} s); {choice}",
                cmd, "default options ≥ 0.75 of the limit, ≤ 1.25× the best fixed",
                r["share_of_limit"] >= 0.75 and over <= 1.25, r))
        else:
            out.append(line(
                "forward-bound corpus (the plan's second case)", "`attnkit extract` with default options, MiniLM on "
                "STS-B dev (both columns), against fixed workers/threads, fresh processes, interleaved medians",
                f"{sec['default']:.2f} s, {over:.2f}× the best fixed ({best}: {sec[best]:.2f} s); {choice}",
                cmd, "≤ 1.25× the best fixed", over <= 1.25, r))
    return out


def row_long(o: argparse.Namespace) -> list[dict]:
    import long

    lens, rounds = ([256], 1) if o.quick else ([4096, 8192], o.repeats or 3)
    threads = torch.get_num_threads()
    res = long.measure(lens, ["sdpa", "attnkit"], rounds, threads)
    cmd = (f"python bench/long.py --lengths {','.join(map(str, lens))} --configs sdpa,attnkit --rounds {rounds} "
           f"--threads {threads}")
    med = {(m["L"], m["config"]): m for m in res["medians"]}
    out = []
    for L in lens:
        want = 0.95 if L <= 4096 else 0.9
        target = f"≥ {want}× sdpa's tokens/s, peak RSS ≤ 1.05×"
        what = (f"SmolLM2-135M, one sample of {L} tokens, fp32: extraction tokens/s and peak RSS against an sdpa "
                "forward without a KV cache, a fresh process per run, interleaved medians")
        a, s = med.get((L, "attnkit")), med.get((L, "sdpa"))
        if not (a and s):
            failed = [r for r in res["runs"] if r["L"] == L and "failed" in r]
            why = failed[0]["failed"] if failed else "skipped (memory estimate)"
            out.append(line(f"SmolLM2 at L={L}", what, f"not measured: {why}", cmd, target, None,
                            {"runs": res["runs"]}))
            continue
        speed, rss = a["tokens_per_s"] / s["tokens_per_s"], a["peak_mb"] / s["peak_mb"]
        out.append(line(
            f"SmolLM2 at L={L}", what,
            f"{speed:.2f}× sdpa's tokens/s ({a['tokens_per_s']:.0f} vs {s['tokens_per_s']:.0f}); peak RSS {rss:.2f}× "
            f"({a['peak_mb']:,.0f} vs {s['peak_mb']:,.0f} MB)",
            cmd, target, speed >= want and rss <= 1.05, {"attnkit": a, "sdpa": s}))
    return out


def row_busy(o: argparse.Namespace) -> list[dict]:
    import regimes

    quick, stsb = o.quick, o.stsb
    if quick:
        cases, regs, neighbour, n, limit = ["extract" if stsb.exists() else "detect"], ["auto", "passive"], "no", 48, 4
    else:
        cases, regs, neighbour = ["extract", "detect", "ablate"], ["auto", "default", "passive"], "both"
        n, limit = 1000, 16
        if not stsb.exists():
            print(f"no {stsb}: the busy row leaves out extract on short texts")
            cases.remove("extract")
    repeats = 1 if quick else o.repeats or 1
    res = regimes.measure(cases, regs, neighbour, repeats, n, limit, stsb)
    cmd = (f"python bench/regimes.py --cases {','.join(cases)} --regimes {','.join(regs)} --neighbour {neighbour} "
           f"--repeats {repeats} --n {n} --ablate-limit {limit} --stsb {stsb}")
    names = {"extract": f"extract ({n} sentences)", "detect": "detect-heads smollm2 --sequences 4 --length 50",
             "ablate": f"ablate smollm2 --task lm --limit {limit}"}
    out = []
    for cond, by_case in res.items():
        cells = []
        for case, by_regime in by_case.items():
            best = min(by_regime, key=lambda g: by_regime[g]["wall"])
            auto = by_regime["auto"]
            cells.append(f"{names[case]}: auto {auto['wall']:.1f} s = {auto['over_best']:.2f}× the best ({best} "
                         f"{by_regime[best]['wall']:.1f} s)")
        worst = max(v["auto"]["over_best"] for v in by_case.values())
        out.append(line(
            "busy machine, " + ("as it is" if cond == "quiet" else "beside a 2-thread torch process"),
            "every command in attnkit's own wait regime (auto) against the best of " + ", ".join(regs)
            + ", a fresh process per run, interleaved",
            "; ".join(cells), cmd, "every command within 1.3× of its best regime", worst <= 1.3, by_case))
    return out


RUNNERS = {"short": row_short, "minilm": row_minilm, "lengths": row_lengths, "plan": row_plan, "long": row_long,
           "busy": row_busy}


# --- the table ---------------------------------------------------------------------------------------------------
def machine() -> dict:
    from attnkit import backend_info

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
            "waits": REGIME, "attnkit_backend": backend_info(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def met_cell(met, quick: bool) -> str:
    if quick:
        return "n/a (--quick)"
    return {True: "yes", False: "**no**", None: "—"}[met]


def render(m: dict, lines: list[dict], quick: bool) -> str:
    head = (f"{m['cpu']} (lscpu), {m['cores']} CPUs; torch {m['torch']}, {m['threads']} threads, {m['capability']}; "
            f"waits: {m['waits']}; attnkit {m['attnkit_backend']}; {m['date']}"
            + ("; --quick: smoke sizes, the figures say nothing about the targets" if quick else ""))
    out = [head, "", "| case | what it measures | measured (command) | target | met? | load before → after |",
           "|---|---|---|---|---|---|"]
    for x in lines:
        cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
        out.append(f"| {cell(x['case'])} | {cell(x['what'])} | {cell(x['measured'])} (`{cell(x['command'])}`) | "
                   f"{cell(x['target'])} | {met_cell(x['met'], quick)} | {x['load_before']} → {x['load_after']} |")
    return "\n".join(out)


def rows_arg(text: str) -> list[str]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise argparse.ArgumentTypeError(f"unknown row {', '.join(bad) or repr(text)} (rows: {', '.join(ROWS)})")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=rows_arg, default=list(ROWS), help="rows to run, comma-separated: "
                    + ", ".join(ROWS))
    ap.add_argument("--quick", action="store_true", help="smoke sizes: seconds per row, the targets not judged")
    ap.add_argument("--json", default=None, help="write the table (and every row's figures) to this file")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (repeats) of every row instead of its own "
                    "(short 5, minilm 3, lengths 5, plan 3, long 3, busy 1)")
    ap.add_argument("--stsb", type=Path, default=STSB, help="GLUE STS-B dev (short, plan, busy)")
    args = ap.parse_args(argv)
    m = machine()
    print(f"{m['cpu']}; torch {m['torch']}, {m['threads']} threads; waits: {m['waits']}; load {load()}", flush=True)
    lines, failed = [], False
    for row in [r for r in ROWS if r in args.only]:
        before = load()
        print(f"\n=== {row} (load {before})", flush=True)
        t0 = time.perf_counter()
        try:
            got = RUNNERS[row](args)
        except (Exception, SystemExit) as e:  # noqa: BLE001 (a failed row is reported; the others still run)
            failed = True
            msg = str(e).strip().splitlines()
            got = [line(row, "", f"failed: {type(e).__name__}: {msg[-1] if msg else ''}", "", "", None, {})]
        after = load()
        for x in got:
            x.update(row=row, load_before=before, load_after=after, seconds=time.perf_counter() - t0)
        lines.extend(got)
    table = render(m, lines, args.quick)
    print("\n" + table)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, "quick": args.quick, "lines": lines}, indent=1,
                                              default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
