"""`bench compare --retention-suite`: which answer-retention suite the `ret:` cells run
(quality/retention_suites.py says what each asks, and its --retention-* defaults, which fill
only the values not given). Also `--device`: the reference model's device (cuda runs the same
cells on a GPU).
"""

from __future__ import annotations

import argparse

from ctxcache.quality import retention_suites as suites
from ctxcache.quality.texts import WIDE_KINDS
from ctxcache.quality.wide_tasks import WideSpec
from ctxcache.quality.copy_tasks import CopySpec


def add_suite_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--retention-suite", choices=suites.SUITES, default="bundled",
                    help="bundled: the six bundled kinds; wide: number-dense kinds (issue 45)")
    ap.add_argument("--device", default="cpu", help="the model's device: cpu, cuda, cuda:1, ...")


def apply_suite(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """The suite's defaults where no --retention-* value was given (one equal to the bundled
    suite's default stands: `--retention-seeds 0,1,2` of the wide suite runs seeds 0-2); the wide
    suite's kinds checked up front (a bad kind would otherwise fail only when its cell runs,
    after the model loads)."""
    if args.device != "cpu" and "fid" not in args.skip.split(","):
        # the fidelity capture (capture.py, model_scores.py) builds its token tensors on the host
        ap.error(f"--device {args.device}: fidelity cells run on the CPU only; add --skip fid")
    for dest, value in suites.DEFAULTS[args.retention_suite].items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if args.retention_suite != "wide":
        return
    bad = [f for f in args.retention_fillers.split(",") if f and f not in WIDE_KINDS]
    if bad:
        ap.error(f"--retention-fillers {bad}: the wide suite's kinds are {WIDE_KINDS}")


def suite_config(args: argparse.Namespace) -> dict:
    """What the shards' config records: nothing for the bundled suite, so shards written
    before the option existed still merge with new ones."""
    return {"suite": "wide"} if args.retention_suite == "wide" else {}


def retention_spec(args: argparse.Namespace, n_tokens: int, filler: str) -> CopySpec | WideSpec:
    return suites.retention_spec(args.retention_suite, n_tokens, filler, args.doc_questions)
