"""`gpu-sched` command line: conformance (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

BACKENDS = ("reference",)


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def make_scheduler_factory(backend: str, device: Optional[str] = None):
    """`factory(config, kv_pool_size, shuffle)` for a backend name."""
    if backend == "reference":
        from .reference import ReferenceScheduler

        return lambda cfg, kv, shuffle=None: ReferenceScheduler(cfg, kv, shuffle=shuffle)
    raise CliError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def cmd_conformance(args) -> int:
    from .conformance import run_file

    factory = make_scheduler_factory(args.backend, args.device)
    try:
        _, failed = run_file(args.file, factory)
    except FileNotFoundError as e:
        raise CliError(str(e)) from None
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-sched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("conformance", help="run conformance scenarios (FORMAT.md) and print 'N passed, M failed'")
    c.add_argument("file", help="scenario file (.jsonl or .jsonl.gz)")
    c.add_argument("--backend", default="reference", help="scheduler backend (default: reference)")
    c.add_argument("--device", default=None, help="torch device for device backends")
    c.set_defaults(func=cmd_conformance)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"gpu-sched: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
