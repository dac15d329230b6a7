"""Benchmark: extraction on an encoder–decoder and on a vision transformer against the same model's plain sdpa
forward on the same batches (issues 48 and 49; docs/seq2seq.md, docs/features.md §10).

    python bench/families.py [--models marian,t5,vit,dinov2] [--rounds 5] [--batch 16] [--tokens 16,48]

Models are random-weight copies of published shapes, built offline from their configs (the figure is the cost of
the forward and the features, which weights do not change):
  marian   Marian / OPUS-MT base: 6 + 6 layers, d_model 512, 8 heads, vocabulary 32,000; (source, target) pairs of
           16-48 tokens each (--tokens LO,HI), right-padded, teacher-forced
  t5       T5-small: 6 + 6 layers, d_model 512, 8 heads, with its relative-position bias (docs/seq2seq.md §3); long
           pairs (--tokens 1024,1024 --batch 1) show what the bias costs where the op runs it
  vit      ViT-B/16 at 224 × 224 (197 tokens, 12 layers, 768 wide, 12 heads)
  dinov2   DINOv2-S/14 with 4 registers at 224 × 224 (261 tokens, 12 layers, 384 wide, 6 heads)
Configurations, interleaved (the order rotates every round), medians after one warm-up round:
  sdpa      the model with transformers' sdpa attention: `model(**inputs)` (an encoder–decoder's includes its
            language-model head)
  sdpa-base the same forward without the head (`model.get_decoder()`'s output, as extraction stops there): the
            encoder–decoders only
  extract   attnkit's features of every head of every layer (all kinds) on the same batches
            (`attnkit.engine.forward.forward_features` inside `measuring`, as `attnkit extract` runs each batch)
The CPU model and load are printed with the figures; run it quiet, then beside another process, and say which.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

try:
    import attnkit  # noqa: F401
except ImportError:  # run from a source checkout: python bench/families.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attnkit.engine.openmp import configure  # noqa: E402

REGIME = configure()  # before torch loads, as every attnkit command does

import torch  # noqa: E402
from short import cpu_model, load  # noqa: E402  (bench/short.py)

SEQ2SEQ = ("marian", "t5")
VISION = ("vit", "dinov2")


def seq2seq_model(kind: str):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    if kind == "t5":
        cfg = AutoConfig.for_model("t5", vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                                   num_decoder_layers=6, num_heads=8, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    else:
        cfg = AutoConfig.for_model("marian", vocab_size=32000, d_model=512, encoder_layers=6, decoder_layers=6,
                                   encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                                   decoder_ffn_dim=2048, max_position_embeddings=512, pad_token_id=0,
                                   eos_token_id=2, decoder_start_token_id=0)
    torch.manual_seed(0)
    return AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation="sdpa").eval()


def vision_model(kind: str):
    from transformers import AutoConfig, AutoModel

    if kind == "dinov2":
        cfg = AutoConfig.for_model("dinov2_with_registers", image_size=224, patch_size=14, hidden_size=384,
                                   num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                                   num_register_tokens=4)
    else:
        cfg = AutoConfig.for_model("vit", image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
                                   num_attention_heads=12, intermediate_size=3072)
    torch.manual_seed(0)
    return AutoModel.from_config(cfg, attn_implementation="sdpa").eval()


def seq2seq_batches(kind: str, n_batches: int, batch: int, seed: int = 0, tokens: tuple = (16, 48)):
    """Right-padded (source, target) batches of random ids, `tokens` (lo, hi) a side, EOS last; attnkit's Batch of each
    (the source's lengths and token classes, the target's in `target`: docs/seq2seq.md §4)."""
    from attnkit.features import CLS, OTHER, SEP
    from attnkit.tokens import Batch

    eos = 1 if kind == "t5" else 2
    g = torch.Generator().manual_seed(seed)

    def side(lengths):
        L = int(lengths.max())
        ids = torch.randint(3, 32000, (len(lengths), L), generator=g)
        mask = torch.arange(L)[None] < lengths[:, None]
        ids[torch.arange(len(lengths)), lengths - 1] = eos
        cls = torch.full(ids.shape, OTHER, dtype=torch.int32)
        cls[:, 0] = CLS
        cls[(ids == eos) & mask] = SEP
        cls[~mask] = OTHER
        return ids * mask, mask.long(), cls

    out = []
    for _ in range(n_batches):
        src_n = torch.randint(tokens[0], tokens[1] + 1, (batch,), generator=g)
        tgt_n = torch.randint(tokens[0], tokens[1] + 1, (batch,), generator=g)
        src, src_mask, src_cls = side(src_n)
        tgt, tgt_mask, tgt_cls = side(tgt_n)
        inputs = {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt,
                  "decoder_attention_mask": tgt_mask}
        target = Batch({}, tgt_n, tgt_cls, torch.zeros(tgt.shape, dtype=torch.int32), 0)
        out.append(Batch(inputs, src_n, src_cls, torch.zeros(src.shape, dtype=torch.int32), 0, target))
    return out


def vision_batches(model, n_batches: int, batch: int, seed: int = 0):
    """Batches of random images of the config's size as attnkit's Batch: every token valid, the token classes of
    the model's image layout ([CLS], registers, patches: attnkit/attention/positions.py)."""
    from attnkit.attention.positions import ImageTokens, image_layout
    from attnkit.tokens import Batch

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    layout = image_layout(cfg)
    tokens = ImageTokens(layout, layout.image)
    n_tokens = tokens.length
    out = []
    for _ in range(n_batches):
        px = torch.rand(batch, 3, *layout.image, generator=g)
        classes = tokens.token_class(batch, n_tokens, "cpu").contiguous()
        out.append(Batch({"pixel_values": px}, torch.full((batch,), n_tokens), classes,
                         torch.zeros(batch, n_tokens, dtype=torch.int32), 0))
    return out


def measure(kind: str, rounds: int, batch: int, n_batches: int, tokens: tuple = (16, 48)) -> dict:
    import attnkit
    from attnkit.engine.forward import forward_features, measuring

    seq2seq = kind in SEQ2SEQ
    sdpa = seq2seq_model(kind) if seq2seq else vision_model(kind)
    ours = attnkit.instrument(copy.deepcopy(sdpa))
    batches = (seq2seq_batches(kind, n_batches, batch, tokens=tokens) if seq2seq
               else vision_batches(sdpa, n_batches, batch))
    n_tokens = sum(int(b.lengths.sum()) + (int(b.target.lengths.sum()) if b.target is not None else 0)
                   for b in batches)

    def plain():
        for b in batches:
            sdpa(**b.inputs)

    def base():
        for b in batches:
            sdpa.model(**b.inputs) if hasattr(sdpa, "model") else sdpa.base_model(**b.inputs)

    def extract():
        with measuring(ours):
            for b in batches:
                forward_features(ours, b)

    configs = {"sdpa": plain, **({"sdpa-base": base} if seq2seq else {}), "extract": extract}
    names = list(configs)
    times = {c: [] for c in names}
    print(f"{kind}: {cpu_model()}; waits: {REGIME}; torch threads {torch.get_num_threads()}, "
          f"{torch.backends.cpu.get_cpu_capability()}; {n_batches} batches of {batch}, {n_tokens} tokens")
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0: warm-up
            order = names[r % len(names):] + names[:r % len(names)]
            for c in order:
                t0 = time.perf_counter()
                configs[c]()
                dt = time.perf_counter() - t0
                if r:
                    times[c].append(dt)
                print(f"  round {r}{' (warm-up)' if not r else ''} {c:9s} {dt:7.3f} s  {load()}", flush=True)
    med = {c: statistics.median(v) for c, v in times.items()}
    print("  medians: " + ", ".join(f"{c} {med[c]:.3f} s" for c in names))
    for ref in [c for c in names if c != "extract"]:
        print(f"  extract / {ref}: {med['extract'] / med[ref]:.3f}")
    return med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="marian,t5,vit,dinov2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=4, help="batches per round")
    ap.add_argument("--tokens", default="16,48", help="LO,HI: the tokens of each side of a pair (encoder–decoders)")
    args = ap.parse_args(argv)
    try:
        tokens = tuple(int(x) for x in args.tokens.split(","))
        assert len(tokens) == 2 and 2 <= tokens[0] <= tokens[1]
    except (ValueError, AssertionError):
        ap.error(f"--tokens must be LO,HI with 2 <= LO <= HI, got {args.tokens!r}")
    for kind in args.models.split(","):
        if kind not in SEQ2SEQ + VISION:
            ap.error(f"unknown model {kind!r}: one of {', '.join(SEQ2SEQ + VISION)}")
    for kind in args.models.split(","):
        measure(kind, args.rounds, args.batch if kind in SEQ2SEQ else max(1, args.batch // 2), args.batches, tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
