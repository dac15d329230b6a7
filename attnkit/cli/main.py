"""The `attnkit` command group. Every command lives in a module of this package and is click only: it parses
its options, calls the library (the jobs in attnkit/engine/, attnkit/analysis/, attnkit/ablation/,
attnkit/probe/) inside the function, and prints results, so `attnkit --help` loads no command's library."""
from __future__ import annotations

import logging
import os
import sys

import click

from ..engine.openmp import configure as configure_waits
from ..process import end_environ_until_torch
from .ablate import ablate
from .analysis import cluster_cmd, compare_cmd, distances_cmd, report_cmd
from .compare_models import compare_models_cmd
from .detect import detect_heads_cmd
from .export import export_cmd
from .extract import extract
from .options import CommandLine
from .patterns import patterns_cmd
from .probe import probe
from .prune import prune_cmd

COMMANDS = (extract, cluster_cmd, distances_cmd, report_cmd, compare_cmd, patterns_cmd, compare_models_cmd, ablate,
            export_cmd, probe, prune_cmd, detect_heads_cmd)


@click.group(cls=CommandLine, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="attnkit")
def main():
    """Measure what the attention heads of transformer encoders and decoder language models do, over whole
    corpora, and what a model loses when heads change.

    \b
    Typical session:
      attnkit extract corpus.txt -o run      per-head features (features.npz, meta.json)
      attnkit cluster run                    head types (clusters.json)
      attnkit report run                     figures and report.html
      attnkit ablate default --task stsb --data dev.tsv --experiment heads
    A decoder (the embedded SmolLM2, or a local Llama, Qwen, Mistral, Gemma, GPT-2 directory):
      attnkit extract corpus.txt --model smollm2 -o run
      attnkit detect-heads smollm2 -o run    previous-token, duplicate, induction heads
      attnkit ablate smollm2 --task lm --data corpus.txt --experiment layers -o run
      attnkit report run                     sink heads, detected heads, loss ablations

    Models are local directories (no hub downloads); the default is the embedded MiniLM.
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # how torch's threads wait, for every command, before any of them imports torch (libgomp reads it once); the
    # variables leave the environment when torch has loaded, or when a command that never loads it ends
    # (attnkit.process, docs/process.md)
    configure_waits()
    click.get_current_context().call_on_close(end_environ_until_torch)
    # transformers and huggingface_hub read these when they are imported, which happens only once a command's
    # work starts (never for --help or a usage error): attnkit shows its own progress, and only its warnings
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # already imported (the command line called from Python): tell it directly
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


for _command in COMMANDS:
    main.add_command(_command)

__all__ = ["COMMANDS", "main"]
