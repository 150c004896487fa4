"""What the benchmark scripts share about their command lines: counts with a floor, lists of
sizes, and the result files they append rows to (one JSON list of row objects per file).
Every check reports through `error` (an argparse parser's `error`: one line, exit status 2)
before any work, so a bad argument never costs a run."""

import json
import os
from pathlib import Path
from typing import Callable, List

from gpu_sched.cli import unwritable_reason


def at_least(args, error: Callable[[str], None], floors: dict) -> None:
    """`error` for the first option whose value (not None) is below its floor; `floors` maps an
    argparse destination (e.g. "max_reps", shown as --max-reps) to its smallest value."""
    for name, lo in floors.items():
        v = getattr(args, name)
        if v is not None and v < lo:
            error(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")


def int_list(text: str, flag: str, error: Callable[[str], None]) -> List[int]:
    """`text` as comma-separated ints >= 1 (e.g. queue sizes); `error` otherwise, naming `flag`."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        error(f"{flag} must be comma-separated ints >= 1, got {text!r}")
    return vals


def existing_rows(path, error: Callable[[str], None]) -> list:
    """The rows already in `path` ([] when it is missing or empty), read before a run so that a
    file the run could not append to stops it at once rather than after it: `error` for a
    folder, a place the rows cannot be written, text that is not JSON, or JSON that is not a
    list."""
    p = Path(path)
    if p.is_dir():
        error(f"--out {p} is a folder, not a JSON file")
    why = unwritable_reason(p.absolute().parent)  # `write_rows` writes a file beside it, renamed over it
    if why:
        error(f"--out {p}: cannot write in its folder: {why}")
    if not p.exists() or p.stat().st_size == 0:
        return []
    try:
        rows = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        error(f"--out {p} is not a JSON list of rows to append to ({e})")
    if not isinstance(rows, list):
        error(f"--out {p} holds a JSON {type(rows).__name__}, not a list of rows to append to")
    return rows


def write_rows(path, rows: list) -> None:
    """Write `rows` (the old ones and this run's) to `path` as a JSON list: to a file beside
    it, then renamed over it, so an interrupted write leaves the old rows whole. Missing
    folders are made."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    os.replace(tmp, p)
