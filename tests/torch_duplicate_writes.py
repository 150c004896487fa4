"""Writes through an index tensor that a GPU may resolve differently from a CPU.

PyTorch's indexed writes (`scatter_` without a reduction, `index_put_` / `x[idx] = v` without
accumulation, `index_copy_`, `put_`) are deterministic on a CPU when an index repeats (the
last write wins) but not on CUDA, where the writes race and any of them may land; indexed
float sums (`index_add_`, `scatter_add_`, `scatter_reduce_` with "sum" or "mean") add in no set
order there. The torch backend runs the same ops on both, so a step that passes on the CPU
could give another decision on a GPU. `DuplicateWriteWatch` (a `TorchFunctionMode`) checks
each such call on CPU tensors: a repeated destination with two different values written, or
a repeated destination of a float sum, raises AssertionError naming the op and the index (or
is recorded, with `raise_on_duplicate=False`). Integer reductions (`scatter_reduce_` amax,
amin, sum, prod; `index_add_` on integers) are exact in any order and pass.

Use: `with DuplicateWriteWatch(): ...`; `tests/conftest.py` runs every test under it.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from interp_races import first_conflict

T = torch.Tensor


def _np(x) -> Optional[np.ndarray]:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.is_sparse or x.dtype == torch.bfloat16:
            return None
        return x.detach().resolve_conj().numpy()
    return np.asarray(x)


def _scatter_dest(self: T, dim: int, index: np.ndarray) -> np.ndarray:
    """Linear destinations of `self.scatter_(dim, index, ...)`: index's positions with their
    coordinate along dim replaced by the index value."""
    dim = dim % max(self.dim(), 1)
    coords = list(np.indices(index.shape))
    coords[dim] = index
    return np.ravel_multi_index(coords, tuple(self.shape), mode="wrap") if self.dim() else index


class DuplicateWriteWatch(TorchFunctionMode):
    """Check indexed writes on CPU tensors for order-dependent repeats (module doc).
    `found` lists (op, destination) pairs."""

    def __init__(self, raise_on_duplicate: bool = True):
        super().__init__()
        self.raise_on_duplicate = raise_on_duplicate
        self.found: List[tuple] = []
        self.checked = 0
        self.unread: List[str] = []  # calls whose arguments this watch could not read (left to torch)

    def _flag(self, op: str, dest: int, why: str) -> None:
        self.found.append((op, dest))
        if self.raise_on_duplicate:
            raise AssertionError(f"order-dependent indexed write on a GPU: {op} {why} (flat index {dest})")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            self._check(func, args, kwargs)
        except AssertionError:
            raise
        except Exception as e:  # an argument form this watch does not read: leave it to torch
            self.unread.append(f"{getattr(func, '__name__', func)}: {e!r}")
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs) -> None:
        name = getattr(func, "__name__", "")
        if name in ("scatter_", "scatter"):
            self_, dim, index = args[0], args[1], args[2]
            src = args[3] if len(args) > 3 else kwargs.get("src", kwargs.get("value"))
            if kwargs.get("reduce") is not None:
                return
            idx = _np(index)
            if idx is None or not isinstance(self_, torch.Tensor):
                return
            self.checked += 1
            vals = _np(src)[tuple(slice(0, n) for n in idx.shape)] if isinstance(src, torch.Tensor) else None
            if vals is None:
                return  # one scalar value: every repeat writes the same
            d = first_conflict(_scatter_dest(self_, dim, idx), vals)
            if d is not None:
                self._flag(name, d, "writes two different values to one place")
        elif name in ("scatter_add_", "scatter_add", "scatter_reduce_", "scatter_reduce"):
            self_, dim, index = args[0], args[1], args[2]
            reduce = args[4] if len(args) > 4 else kwargs.get("reduce", "sum")
            if not self_.dtype.is_floating_point or reduce not in ("sum", "mean"):
                return
            idx = _np(index)
            if idx is None:
                return
            self.checked += 1
            d = first_conflict(_scatter_dest(self_, dim, idx), None)
            if d is not None:
                self._flag(name, d, "adds floats to one place in no set order")
        elif name in ("index_add_", "index_add"):
            self_, dim, index = args[0], args[1], args[2]
            if not self_.dtype.is_floating_point:
                return
            idx = _np(index)
            if idx is None:
                return
            self.checked += 1
            d = first_conflict(idx, None)
            if d is not None:
                self._flag(name, d, "adds floats to one place in no set order")
        elif name in ("index_copy_", "index_copy"):
            self_, dim, index, source = args[0], args[1], args[2], args[3]
            idx = _np(index)
            if idx is None:
                return
            self.checked += 1
            src = _np(source)
            rows = np.moveaxis(src.reshape(src.shape or (1,)), dim % max(src.ndim, 1), 0).reshape(len(idx), -1) \
                if src is not None and src.ndim else None
            if rows is None:
                return
            order = np.argsort(idx, kind="stable")
            si, sr = idx[order], rows[order]
            rep = np.flatnonzero((si[1:] == si[:-1]) & (sr[1:] != sr[:-1]).any(axis=1))
            if rep.size:
                self._flag(name, int(si[rep[0]]), "copies two different rows to one index")
        elif name in ("put_", "put"):
            self_, index, source = args[0], args[1], args[2]
            acc = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            idx = _np(index)
            if idx is None:
                return
            self.checked += 1
            idx = np.where(idx < 0, idx + self_.numel(), idx)
            if acc:
                d = first_conflict(idx, None) if self_.dtype.is_floating_point else None
                if d is not None:
                    self._flag(name, d, "adds floats to one place in no set order")
                return
            d = first_conflict(idx, _np(source))
            if d is not None:
                self._flag(name, d, "writes two different values to one place")
        elif name in ("index_put_", "index_put", "__setitem__"):
            self_ = args[0]
            if name == "__setitem__":
                key, values, acc = args[1], args[2], False
            else:
                key, values = args[1], args[2]
                acc = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            keys = key if isinstance(key, (tuple, list)) else (key,)
            tens = [k for k in keys if isinstance(k, torch.Tensor)]
            if not tens or any(k.dtype == torch.bool for k in tens) or len(keys) > self_.dim():
                return
            if any(not isinstance(k, torch.Tensor) for k in keys):
                return  # slices / ints beside index tensors: not read here
            arrs = [_np(k) for k in keys]
            if any(a is None for a in arrs):
                return
            self.checked += 1
            arrs = np.broadcast_arrays(*arrs)
            dims = tuple(self_.shape[: len(arrs)])
            flat = np.ravel_multi_index([np.where(a < 0, a + n, a) for a, n in zip(arrs, dims)], dims)
            if acc:
                d = first_conflict(flat, None) if self_.dtype.is_floating_point else None
                if d is not None:
                    self._flag(name, d, "adds floats to one place in no set order")
                return
            if len(arrs) < self_.dim():
                return  # whole sub-tensors per index: rows compared would need their values; not read here
            vals = _np(values) if isinstance(values, torch.Tensor) else None
            if vals is None or vals.size < 2:
                return
            d = first_conflict(flat, np.broadcast_to(vals, flat.shape))
            if d is not None:
                self._flag(name, d, "writes two different values to one place")
