"""GPU kernels the TensorRT backend compiles into its engines, each beside a plain torch reference.

`flash_attention` holds the Triton kernels of the `aotlm.FlashAttention` op (after rotary, which runs outside the
kernel) and thin torch launchers; `reference` holds the float64 meaning they are checked against. The package
needs torch and triton, so only the TensorRT backend imports it: the onnxruntime runtime path never does, and
nothing here is imported by `runtime/__init__.py` (a deployed onnxruntime artifact must not need torch).
"""
