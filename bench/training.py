"""Benchmark: a training step through attnkit with per-head statistics against the same model under sdpa
(issue 36; docs/training.md, "Cost").

    python bench/training.py                       # both models, 3 rounds
    python bench/training.py --models bert --rounds 2 --steps 2 --json training.json

Models (random weights, fp32, batch 1, CPU with `--threads` threads):
  bert     a BERT-base-sized encoder (12 layers, 12 heads of 64, hidden 768) at L = 512, loss: the mean of its output
  smollm2  a SmolLM2-135M-sized Llama decoder (30 layers, 9 query heads and 3 KV heads of 64, hidden 576) at
           L = 2048, loss: next-token cross-entropy
Configurations:
  sdpa     transformers' sdpa attention
  attnkit  attnkit attention (its backward: docs/training.md), no statistics
  tracked  attnkit under attnkit.track(features=("entropy", "max_logit", "cls")), read after every step
Each (model, configuration, round) runs in a fresh process: build the model, one warm-up step, reset the peak RSS
(/proc/self/clear_refs), time `--steps` steps (forward, backward, AdamW step), read the peak (VmHWM). Reported:
seconds per step (wall clock), the process's CPU seconds per step (user + system, time.process_time: on a machine
shared with other jobs the wall clock also counts the waits for a core, the CPU time only the work done; with
OMP_WAIT_POLICY=PASSIVE idle threads do not spin) and the peak RSS rise over the steps, medians over rounds run
interleaved (sdpa, attnkit, tracked, sdpa, ...), and each configuration's ratio to sdpa.

--same-process instead builds every configuration's model (--configs: which) in one fresh process and interleaves
their steps (sdpa, attnkit, tracked, sdpa, ...) after a warm-up step each, `--steps` timed steps per configuration:
a change of the machine's load then hits every configuration alike (on a shared machine the only ratios that mean
much); it reports no memory (the process holds every model).

    python bench/training.py --models bert --same-process --steps 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extract import rss_kb  # noqa: E402  (bench/extract.py: a field of /proc/self/status)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("sdpa", "attnkit", "tracked")
MODELS = {"bert": 512, "smollm2": 2048}


def build(model_name: str, impl: str):
    import torch
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model_name == "bert":
        cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         max_position_embeddings=512, attn_implementation=impl, attention_probs_dropout_prob=0.0,
                         hidden_dropout_prob=0.0)
        return BertModel(cfg)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=2048,
                      tie_word_embeddings=True, attn_implementation=impl)
    return LlamaForCausalLM(cfg)


def setup(model_name: str, config: str):
    """(step, context): one training step of `model_name` under `config` (forward, backward, AdamW step; the tracked
    configuration reads its tracker after every step), and the context it runs in (attnkit.track or nothing), which
    yields the tracker `step` takes."""
    import contextlib

    import torch

    import attnkit

    impl = "sdpa" if config == "sdpa" else "attnkit"
    model = build(model_name, impl).train()
    if impl == "attnkit":
        attnkit.instrument(model)
    L = MODELS[model_name]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, L), generator=g)
    mask = torch.ones(1, L, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ctx = attnkit.track(model, ("entropy", "max_logit", "cls")) if config == "tracked" else contextlib.nullcontext()

    def step(tracker):
        if model_name == "bert":
            loss = model(input_ids=ids, attention_mask=mask).last_hidden_state.float().pow(2).mean()
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tracker is not None:
            tracker.read()

    return step, ctx


def one(model_name: str, config: str, steps: int) -> dict:
    step, ctx = setup(model_name, config)
    with ctx as tracker:
        step(tracker)  # warm-up (optimizer state allocated)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = rss_kb("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(tracker)
        dt = (time.perf_counter() - t0) / steps
        cpu = (time.process_time() - c0) / steps
        peak = rss_kb("VmHWM")
    return {"model": model_name, "config": config, "s_per_step": dt, "cpu_s_per_step": cpu,
            "rise_mb": (peak - before) / 1024,
            "peak_mb": peak / 1024}


def same_process(model_name: str, steps: int, configs=CONFIGS) -> list[dict]:
    """Every configuration's model in this one process, their steps interleaved (sdpa, attnkit, tracked, sdpa, ...)
    after one warm-up step each: a change of the machine's load hits every configuration alike. One dict per
    (configuration, step); no memory (the process holds every model)."""
    import contextlib

    out = []
    with contextlib.ExitStack() as stack:
        runs = {}
        for config in configs:
            step, ctx = setup(model_name, config)
            runs[config] = (step, stack.enter_context(ctx))
        for config in configs:  # warm-up (optimizer state allocated)
            runs[config][0](runs[config][1])
        for r in range(steps):
            for config in configs:
                step, tracker = runs[config]
                t0, c0 = time.perf_counter(), time.process_time()
                step(tracker)
                res = {"model": model_name, "config": config, "s_per_step": time.perf_counter() - t0,
                       "cpu_s_per_step": time.process_time() - c0, "round": r}
                out.append(res)
                print(json.dumps(res), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert,smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--same-process", action="store_true",
                   help="time every configuration in one process, steps interleaved (--steps each after a warm-up "
                        "step; no memory figures), instead of a fresh process per (configuration, round)")
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--configs", default=",".join(CONFIGS), help="with --same-process: which of them (sdpa first)")
    p.add_argument("--same-process-of", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(one(a.one[0], a.one[1], a.steps)))
        return
    if a.same_process_of:
        import torch

        torch.set_num_threads(a.threads)
        same_process(a.same_process_of, a.steps, tuple(a.configs.split(",")))
        return
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = []
    if a.same_process:
        for model_name in a.models.split(","):
            out = subprocess.run([sys.executable, __file__, "--same-process-of", model_name, "--steps", str(a.steps),
                                  "--threads", str(a.threads), "--configs", a.configs], capture_output=True, text=True,
                                 env=env)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"{model_name} failed")
            for line in out.stdout.strip().splitlines():
                if line.startswith("{"):
                    results.append(json.loads(line))
                    print(line, flush=True)
        report(results, a.json, memory=False)
        return
    for model_name in a.models.split(","):
        for r in range(a.rounds):
            for config in CONFIGS:
                out = subprocess.run([sys.executable, __file__, "--one", model_name, config, "--steps", str(a.steps),
                                      "--threads", str(a.threads)], capture_output=True, text=True, env=env)
                if out.returncode:
                    print(out.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"{model_name}/{config} failed")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res["round"] = r
                results.append(res)
                print(json.dumps(res), flush=True)
    report(results, a.json)


def report(results: list[dict], json_path=None, memory: bool = True) -> None:
    """The table of medians per (model, configuration) and their ratios to sdpa."""
    print(f"\nload: {os.getloadavg()}")
    print("| model | L | config | s / step | × sdpa | CPU s / step | × sdpa | peak RSS rise (MB) | × sdpa |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model_name in dict.fromkeys(x["model"] for x in results):
        med = {}
        configs = list(dict.fromkeys(x["config"] for x in results if x["model"] == model_name))
        for config in configs:
            rs = [x for x in results if x["model"] == model_name and x["config"] == config]
            fields = ("s_per_step", "cpu_s_per_step") + (("rise_mb",) if memory else ())
            med[config] = tuple(statistics.median(x[f] for x in rs) for f in fields) + (float("nan"),) * (not memory)
        for config in configs:
            t, c, m = med[config]
            t0, c0, m0 = med["sdpa"]
            print(f"| {model_name} | {MODELS[model_name]} | {config} | {t:.2f} | {t / t0:.2f} | {c:.2f} | "
                  f"{c / c0:.2f} | {m:.0f} | {m / m0:.2f} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
