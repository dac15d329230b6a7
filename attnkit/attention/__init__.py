"""The attention path of `attn_implementation="attnkit"` as steps (attnkit/hf_attention.py runs them):

- `runtime`: what an instrumented model carries (`Runtime`: settings, the consumers attached, what the blocks open
  on it give the next forwards, the forwards under way) and what an intervention does to a layer (`LayerPart`);
- `context`: the context of one forward (`Forward`: its inputs, attnkit's batch, the sentence ids and the
  intervention given when it began), set once per forward;
- `layout`: lengths and left padding from the 2-D mask;
- `call`: reading one call of the attention function into a frozen `AttentionCall` (and the decoder arguments);
- `cross`, `kinds`: an encoder–decoder's cross-attention read into a `CrossAttentionCall`; the kinds of its layers
  (encoder, decoder, cross) and attnkit's numbering of them (docs/seq2seq.md);
- `sentences`: the sentence ids of a plain forward, for region interventions;
- `plan`: the parts of the intervention, the kept heads, what the consumers want of the op (`Plan`);
- `run`: running the op for a plan (and a forward in training with attention dropout);
- `deliver`: the results back in the batch's positions, replaced head outputs, the maps (`maps`), then the
  consumers;
- `consumers/`: what is done with the op's results, one consumer per module behind one protocol.
"""
