"""Compile every Triton kernel for NVIDIA GPUs on a machine without one.

Under `TRITON_INTERPRET=1` (how the tests run the kernels on a CPU) Triton never compiles a
kernel: a kernel that the interpreter runs may still fail to compile for a GPU (an op or
dtype the compiler refuses, a loop it cannot lower). This script closes that gap without a
GPU, in two phases:

1. record: run pytest on the kernel test files (default) in the interpreter, recording each
   launch's kernel and argument types (`InterpretedFunction.run`: tensors as pointer types by
   dtype, ints as i32 / i64 by value, constexpr values as given);
2. compile: in a fresh process without the interpreter, compile every distinct (kernel,
   signature, constexprs) for each target (`triton.compile(ASTSource(...), target=
   GPUTarget("cuda", arch, 32))`, down to PTX and a cubin through the ptxas Triton ships).

Usage:
    python benchmarks/compile_kernels.py [--archs 90,80] [--out compile.json] [pytest args...]

Prints one line per failure and a summary; exit status 1 if any kernel failed to compile.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["tests/test_kernels_sort_keys.py", "tests/test_kernels_radix.py", "tests/test_kernels_admission.py",
                 "tests/test_step_graph.py::test_recorded_step_runs_triton",
                 "tests/test_policy_device.py::test_in_batch_deprioritize_groups_matches_reference"]
_TENSOR_TYPES = {"int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                 "float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _arg_type(v):
    """(kind, value): ("type", Triton type string) for a runtime argument, ("const", v) for
    what the compiler takes as a constant (None)."""
    import torch

    if isinstance(v, torch.Tensor):
        return "type", "*" + _TENSOR_TYPES[str(v.dtype).replace("torch.", "")]
    if v is None:
        return "const", None
    if isinstance(v, bool):
        return "type", "i1"
    if isinstance(v, int):
        return "type", "i32" if -(2**31) <= v < 2**31 else ("i64" if v < 2**63 else "u64")
    if isinstance(v, float):
        return "type", "fp32"
    raise TypeError(f"an argument of type {type(v).__name__} ({v!r})")


def record(pytest_args, out_path: Path) -> int:
    """Phase 1 (TRITON_INTERPRET=1): run pytest in this process, writing the distinct launches."""
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    seen = {}
    run0 = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = inspect.signature(fn).parameters
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        sig, consts = {}, {}
        for name, p in params.items():
            if name not in bound:  # a defaulted parameter
                continue
            v = bound[name]
            if "constexpr" in str(p.annotation):
                sig[name], consts[name] = "constexpr", v
                continue
            kind, t = _arg_type(v)
            if kind == "const":
                sig[name], consts[name] = "constexpr", t
            else:
                sig[name] = t
        key = json.dumps([fn.__module__, fn.__qualname__, sig, consts], sort_keys=True, default=str)
        seen[key] = seen.get(key, 0) + 1
        return run0(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        rc = pytest.main(["-n", "0", "-p", "no:cacheprovider", *pytest_args])  # in this process: the hook sees every launch
    finally:
        InterpretedFunction.run = run0
    out_path.write_text(json.dumps([json.loads(k) + [n] for k, n in seen.items()]))
    return int(rc)


def compile_all(rec_path: Path, archs, out) -> int:
    """Phase 2 (no interpreter): compile each recorded launch for every arch."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = json.loads(rec_path.read_text())
    rows, failed = [], 0
    for module, name, sig, consts, count in launches:
        fn = getattr(importlib.import_module(module), name)
        for arch in archs:
            t0 = time.perf_counter()
            try:
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32))
                err = None
            except Exception as e:  # the compiler's own error, reported per kernel
                err = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                failed += 1
                print(f"FAILED {module}.{name} sm_{arch} {consts}: {err}", flush=True)
            rows.append({"kernel": f"{module}.{name}", "arch": arch, "signature": sig, "constexprs": consts,
                         "launches_recorded": count, "seconds": round(time.perf_counter() - t0, 3), "error": err})
    kernels = collections.Counter(r["kernel"] for r in rows)
    print(f"compiled {len(rows) - failed} of {len(rows)} (kernel, signature, arch) combinations: "
          f"{len(kernels)} kernels, {len(launches)} distinct launches, archs {', '.join(f'sm_{a}' for a in archs)}; "
          f"{failed} failed")
    if out:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="90,80", help="CUDA compute capabilities, comma-separated (default %(default)s)")
    ap.add_argument("--out", default=None, help="write one row per compile as JSON")
    ap.add_argument("--phase", choices=("all", "record", "compile"), default="all", help=argparse.SUPPRESS)
    ap.add_argument("--record-file", default=None, help=argparse.SUPPRESS)
    args, pytest_args = ap.parse_known_args(argv)
    archs = [int(a) for a in args.archs.split(",") if a]
    if args.phase == "record":
        return record(pytest_args, Path(args.record_file))
    if args.phase == "compile":
        return compile_all(Path(args.record_file), archs, args.out)
    with tempfile.TemporaryDirectory() as d:
        rec = Path(d) / "launches.json"
        t0 = time.perf_counter()
        env = dict(os.environ, TRITON_INTERPRET="1")
        rc = subprocess.call([sys.executable, __file__, "--phase", "record", "--record-file", str(rec),
                              *(pytest_args or DEFAULT_TESTS)], cwd=ROOT, env=env)
        if rc != 0 or not rec.exists():
            print(f"recording failed (pytest exit status {rc})", file=sys.stderr)
            return 2
        print(f"recorded {len(json.loads(rec.read_text()))} distinct launches in {time.perf_counter() - t0:.0f} s",
              flush=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set: no warning
        return subprocess.call([sys.executable, __file__, "--phase", "compile", "--record-file", str(rec),
                                "--archs", args.archs] + (["--out", args.out] if args.out else []), cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
