"""What a bench reads from a `ctxcache -v serve` log: each build's split (BuildQueue's "built" line)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

_BUILT = re.compile(r"built (\w+): \d+ tokens in [\d.]+s \(build ([\d.]+)s, store write after it ([\d.]+)s\)")


def build_split(log: Path, cids: list[str]) -> dict:
    """Medians over these contexts' builds, from the server's log line of each: the build
    (prefill, index, host copies) and what of the store write was left once it ended."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = [m for m in _BUILT.finditer(text) if m.group(1) in {c[:12] for c in cids}]
    if not found:
        return {"put_build_s": None, "put_write_after_build_s": None}
    return {"put_build_s": statistics.median(float(m.group(2)) for m in found),
            "put_write_after_build_s": statistics.median(float(m.group(3)) for m in found)}
