"""The context of one forward of an instrumented model (`Forward`): what the forward was given and what was in force
when it began, set once and read by every call of the attention function in it (`AttentionCall.forward`).

Blocks set what the next forwards get (`Given`: attnkit's own batch, `Runtime.batch_of`; the user's sentence ids and
the intervention in force, attnkit.interventions' blocks); the Runtime keeps it, and a forward that begins reads it
into its `Forward`, which the Runtime keeps on a stack until the forward ends (attnkit.models' hooks on the base
model: `Runtime.enter_forward`, `exit_forward`). A forward called inside another (a hook that runs the model again)
has its own, and the outer one's comes back when it ends. Attention run outside a forward of the model (a layer
called by hand, a checkpointed layer run again in the backward) gets a Forward of what is given then, with no inputs
seen (`inputs` None).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BatchInfo:
    """What the op needs to know about the batch beyond q, k, v (on the model's device)."""

    lengths: torch.Tensor  # int64 B
    token_class: torch.Tensor | None = None  # int32 B×L
    sentence_id: torch.Tensor | None = None  # int32 B×L
    # an encoder–decoder's batch (docs/seq2seq.md): the decoder's side, its target (the fields above: the source's)
    target: BatchInfo | None = None


@dataclass(frozen=True)
class ModelInputs:
    """What a forward of the instrumented model was given (recorded by attnkit.models' hooks)."""

    input_ids: torch.Tensor | None
    token_type_ids: torch.Tensor | None
    # whether the forward asked for attention maps: GPT-2's attention module takes `output_attentions` itself and
    # does not hand it on to the attention function
    output_attentions: bool = False
    # an encoder–decoder's `decoder_attention_mask`: the layout of cross-attention's queries (docs/seq2seq.md)
    decoder_mask: torch.Tensor | None = None
    image_size: tuple | None = None  # a vision model's forward: (height, width) of its pixel_values


@dataclass(frozen=True)
class Given:
    """What the blocks open on a model give the forwards that begin: attnkit's own batch (`Runtime.batch_of`), the
    user's B×L sentence ids (attnkit.sentences, intervene(sentences=)) and the intervention in force (an
    attnkit.interventions.Intervention or StackedInterventions); None: none."""

    batch: BatchInfo | None = None
    sentences: torch.Tensor | None = None
    intervention: object | None = None


NOTHING_GIVEN = Given()


class ReadsGiven:
    """The fields of a `Given`, read off the `given` of what holds one: a Forward (what its forward began with) and
    the Runtime (what the next forwards get)."""

    @property
    def batch(self) -> BatchInfo | None:
        """attnkit's own batch (`Runtime.batch_of`), or None."""
        return self.given.batch

    @property
    def sentences(self) -> torch.Tensor | None:
        """The user's sentence ids (attnkit.sentences), or None."""
        return self.given.sentences

    @property
    def intervention(self):
        """The intervention in force (attnkit.intervene), or None."""
        return self.given.intervention


@dataclass(frozen=True)
class Forward(ReadsGiven):
    """One forward of the instrumented model: its inputs (None: attention ran outside a forward of the model, whose
    inputs attnkit did not see) and what was given when it began. `derived`: what the steps derive once per forward
    and keep for its later calls (the sentence ids of region interventions, attnkit.attention.sentences)."""

    inputs: ModelInputs | None = None
    given: Given = NOTHING_GIVEN
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def output_attentions(self) -> bool:
        return self.inputs is not None and self.inputs.output_attentions
