"""Fused kernels for tandem's prefill and decode pools.

Each op has a torch reference in ``tandem.kernels.reference`` (the CPU serving path and
the ground truth of every test) and, where a GPU is present, a Triton kernel
with the same signature. ``tandem.kernels.ops`` picks one by the tensors' device.
"""
