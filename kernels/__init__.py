"""Triton kernels of gpu_sched, one file per family; imported as `gpu_sched.kernels`.

Each family file holds private `@triton.jit` kernels and one checked launcher per kernel.
On a machine without a GPU they run under `TRITON_INTERPRET=1`.
"""
