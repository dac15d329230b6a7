"""GPU kernels written in Python (Triton): the op layer's kernels that are not part of the compiled extension.

`triton_attention` is the Triton implementation of `attnkit::fused_attention` for fp16/bf16 CUDA tensors
(docs/cuda.md). Importing this package imports nothing heavy; the Triton module imports `triton` itself.
"""
