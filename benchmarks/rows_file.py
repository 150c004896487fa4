"""The result files the benchmarks append rows to: one JSON list of row objects per file."""

import json
from pathlib import Path
from typing import Callable


def existing_rows(path, error: Callable[[str], None]) -> list:
    """The rows already in `path` ([] when it is missing or empty), read before a run so that a
    file the run could not append to stops it at once rather than after it: `error(message)`
    (an argparse parser's `error`: one line, exit status 2) for a folder, text that is not
    JSON, or JSON that is not a list."""
    p = Path(path)
    if p.is_dir():
        error(f"--out {p} is a folder, not a JSON file")
    if not p.exists() or p.stat().st_size == 0:
        return []
    try:
        rows = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        error(f"--out {p} is not a JSON list of rows to append to ({e})")
    if not isinstance(rows, list):
        error(f"--out {p} holds a JSON {type(rows).__name__}, not a list of rows to append to")
    return rows
