"""Suite-wide setup. Without CUDA the Triton kernels run in Triton's interpreter
on CPU tensors; TRITON_INTERPRET is read when a kernel module is imported, so it
is set here, before any test module can import one."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
