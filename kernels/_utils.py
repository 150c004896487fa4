"""Shared launch helpers for the Triton kernel families (block sizes, warps, argument checks).

Imports no Triton (the torch backend uses the argument checks too). One place decides block sizes and warps (STYLE practice 6, after Liger `ops/utils.py`), and one
place checks launcher arguments, so every family fails with the same clear messages:
`<launcher>: <arg> must be <what>, got <what it is>`.

Whether a kernel runs in Triton's interpreter is decided by Triton when the kernel is
decorated (`TRITON_INTERPRET=1` before the kernel module is imported); launchers ask the kernel
object itself (`is_interpreted`) instead of reading the environment again.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

#: default elements per program of the 1-D element-wise kernels
DEFAULT_BLOCK = 1024
SCAN_BLOCK = 4096  # scan_config's block for long walks
#: smallest block a caller may ask for (Triton's `tl.arange` needs a power of two >= 16 on GPUs)
MIN_BLOCK = 16
MAX_BLOCK = 8192


def block_config(block: Optional[int] = None) -> Tuple[int, int]:
    """(BLOCK, num_warps) for a 1-D element-wise kernel.

    `block` None gives `DEFAULT_BLOCK`; otherwise it must be a power of two in
    [MIN_BLOCK, MAX_BLOCK]. Warps grow with the block: 4 up to 1024 elements, then 8, 16.
    """
    if block is None:
        block = DEFAULT_BLOCK
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block must be an int, got {type(block).__name__} {block!r}")
    if block < MIN_BLOCK or block > MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block}")
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    return block, num_warps


def scan_config(n: int, block: Optional[int] = None) -> Tuple[int, int]:
    """(BLOCK, num_warps) for a single-program kernel that walks n entries block by block,
    carrying its running sums or maxima from one block to the next.

    `block` None gives `DEFAULT_BLOCK` for n up to it and `SCAN_BLOCK` (16 warps) past it: the
    walk is serial, so on a GPU its time is the number of blocks times one block's latency, and
    wider blocks take a long queue in a quarter of the steps. An explicit block is checked as
    in `block_config`.
    """
    if block is None and n > DEFAULT_BLOCK:
        return SCAN_BLOCK, 16
    return block_config(block)


def grid_1d(n: int, block: int) -> Tuple[int]:
    """Programs for n elements (at least one, so a launch over an empty range is harmless)."""
    return (max(1, (n + block - 1) // block),)


def gather(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """src[idx] for a 1-D src and int64 idx of any shape with values in [0, src.numel()), as one
    `index_select` (used by the torch backend: several times cheaper than advanced indexing for
    large random gathers on the CPU; graph-capturable on CUDA)."""
    return src.index_select(0, idx.reshape(-1)).view(idx.shape)


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under `TRITON_INTERPRET=1` (runs on the host)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - layout of older Triton versions
        return type(kernel).__name__ == "InterpretedFunction"
    return isinstance(kernel, InterpretedFunction)


def check_tensor(
    where: str,
    name: str,
    t,
    dtypes: Sequence[torch.dtype],
    *,
    ndim: int = 1,
    numel: Optional[int] = None,
    shape: Optional[Tuple[int, ...]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = True,
) -> None:
    """Raise a clear TypeError/ValueError unless `t` is a tensor of one of `dtypes` with `ndim`
    dims, contiguous (unless `contiguous=False`), and `numel`/`shape`/`device` when given.
    Reads metadata only: never synchronizes with the device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{where}: {name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{where}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{where}: {name} must have {numel} elements, got {t.numel()}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous (call .contiguous() first)")
    if device is not None and t.device != device:
        raise ValueError(f"{where}: {name} is on {t.device}, expected {device} like the other arguments")


def check_launch_device(where: str, kernel, t: torch.Tensor) -> torch.device:
    """The device all arguments must share. A compiled kernel needs GPU tensors; an
    interpreted one runs anywhere."""
    if t.device.type == "meta":
        raise ValueError(f"{where}: meta tensors cannot be launched on; use the torch backend")
    if not is_interpreted(kernel) and t.device.type == "cpu":
        raise ValueError(
            f"{where}: tensors are on the CPU but Triton is not in interpreter mode; move them to the "
            "GPU or set TRITON_INTERPRET=1 before importing the kernels"
        )
    return t.device


def check_int(where: str, name: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """A host-side int argument within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{where}: {name} must be in [{lo}, {hi}], got {value}")
    return value
