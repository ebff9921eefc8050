"""A dpkg.log written by code: the wide retention suite's `dpkglog` kind (quality/corpus/dpkglog.txt).

The kind needs a log's shape (timestamped lines that repeat their openings, package names,
architectures and Debian versions packed together), not any machine's history: the first copy
was a build machine's own /var/log/dpkg.log, whose license nobody could state. This draws
every package name, version and time from one fixed seed, so the file is the same on every
run and every machine; `python -m ctxcache.quality.dpkglog_gen > quality/corpus/dpkglog.txt`
rewrites it, and a test checks the bundled copy equals this output.
"""

from __future__ import annotations

import datetime as dt
import random
import sys

SEED = 45
SIZE = 24_000  # bytes of whole lines: about the first copy's 20 KB, > 4096 tokens of it
START = dt.datetime(2025, 3, 3, 9, 12, 41)
# made-up stems (syllables), so no name is a real package's and the needles' key words
# (quality/copy_tasks.py NAMES, PEOPLE) stay absent
_SYLLABLES = ("ba", "cor", "dex", "fen", "gar", "hul", "kin", "lor", "mib", "nus", "pel", "quo", "ras",
              "tib", "vel", "zor", "tra", "ste", "gli", "pro", "xan", "wum", "yel", "sno", "dru", "fip")
_FORMS = (("lib{s}{so}", "amd64"), ("lib{s}-dev", "amd64"), ("{s}", "amd64"), ("{s}-common", "all"),
          ("{s}-data", "all"), ("python3-{s}", "all"), ("fonts-{s}", "all"), ("{s}-utils", "amd64"),
          ("lib{s}{so}-bin", "amd64"), ("{s}-doc", "all"))
_SUFFIXES = ("", "", "", "+b1", "+b2", "+deb12u1", "+deb12u3", "+ds", "+dfsg", "~deb12u1")


def _version(rng: random.Random) -> str:
    epoch = f"{rng.randint(1, 2)}:" if rng.random() < 0.1 else ""
    upstream = ".".join(str(rng.randint(0, 40 if i else 12)) for i in range(rng.randint(2, 3)))
    return f"{epoch}{upstream}-{rng.randint(1, 9)}{rng.choice(_SUFFIXES)}"


def _bump(version: str, rng: random.Random) -> str:
    """A newer Debian revision of version (an upgrade's new side)."""
    head, _, rev = version.rpartition("-")
    if "deb12u" in rev:  # the next stable update
        return f"{head}-{rev[:-1]}{int(rev[-1]) + 1}"
    return f"{head}-{rev}+deb12u{rng.randint(1, 9)}"


def _package(rng: random.Random, seen: set[str]) -> tuple[str, str]:
    while True:
        stem = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
        form, arch = rng.choice(_FORMS)
        name = form.format(s=stem, so=rng.randint(0, 9))
        if name not in seen:
            seen.add(name)
            return f"{name}:{arch}", _version(rng)


def _session(rng: random.Random, clock: list[dt.datetime], seen: set[str]) -> list[str]:
    """One apt run: unpack some packages (a few upgrades), then configure them, then a trigger."""
    def at(line: str) -> str:
        if rng.random() < 0.3:
            clock[0] += dt.timedelta(seconds=rng.randint(1, 3))
        return f"{clock[0]:%Y-%m-%d %H:%M:%S} {line}"

    pkgs = [(*_package(rng, seen), rng.random() < 0.15) for _ in range(rng.randint(4, 14))]
    out = [at("startup archives unpack")]
    final = []
    for pkg, ver, upgrade in pkgs:
        if upgrade:
            new = _bump(ver, rng)
            out += [at(f"upgrade {pkg} {ver} {new}"), at(f"status half-configured {pkg} {ver}"),
                    at(f"status unpacked {pkg} {ver}"), at(f"status half-installed {pkg} {ver}"),
                    at(f"status unpacked {pkg} {new}")]
        else:
            new = ver
            out += [at(f"install {pkg} <none> {ver}"), at(f"status half-installed {pkg} {ver}"),
                    at(f"status unpacked {pkg} {ver}")]
        final.append((pkg, new))
    out.append(at("startup packages configure"))
    for pkg, ver in final:
        out += [at(f"configure {pkg} {ver} <none>"), at(f"status unpacked {pkg} {ver}"),
                at(f"status half-configured {pkg} {ver}"), at(f"status installed {pkg} {ver}")]
    if rng.random() < 0.5:
        pkg, ver = rng.choice(final)
        out += [at(f"trigproc {pkg} {ver} <none>"), at(f"status half-configured {pkg} {ver}"),
                at(f"status installed {pkg} {ver}")]
    return out


def dpkg_log(seed: int = SEED, size: int = SIZE) -> str:
    """The log: apt runs minutes to days apart, whole lines, at most size bytes, ending in a newline."""
    rng, clock, seen = random.Random(seed), [START], set()
    lines: list[str] = []
    used = 0
    while True:
        for line in _session(rng, clock, seen):
            if used + len(line) + 1 > size:
                return "\n".join(lines) + "\n"
            lines.append(line)
            used += len(line) + 1
        clock[0] += dt.timedelta(minutes=rng.randint(3, 60 * 24 * 3))


if __name__ == "__main__":
    sys.stdout.write(dpkg_log())
