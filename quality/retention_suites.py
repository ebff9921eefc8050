"""The answer-retention suites: which questions a `ret:` cell of `bench compare` asks.

bundled: quality/copy_tasks.py over the six bundled kinds (KINDS) at 2048 / 4096 / 6144.
wide: quality/wide_tasks.py over the number-dense kinds (WIDE_KINDS, issue 45) at 2048 tokens,
seeds 0-19: 25 questions per context, 500 per kind, 2500 in all. SmolLM2 with full attention
answers few of them (seed 0: 27% at 2048, 17% at 4096, 12% in /etc/services at 2048), so
reaching issue 45's 40 right answers per kind takes many contexts (seeds 0-15 left /etc/services
at 39); 2048 is where a right answer costs the least CPU time.
"""

from __future__ import annotations

from ctxcache.quality.copy_tasks import CopySpec
from ctxcache.quality.texts import KINDS, WIDE_KINDS
from ctxcache.quality.wide_tasks import WideSpec

SUITES = ("bundled", "wide")
# each suite's --retention-* defaults (bench compare's names)
DEFAULTS = {
    "bundled": {"retention_lengths": "2048,4096,6144", "retention_fillers": ",".join(KINDS),
                "retention_seeds": "0,1,2"},
    "wide": {"retention_lengths": "2048", "retention_fillers": ",".join(WIDE_KINDS),
             "retention_seeds": ",".join(str(s) for s in range(20))},
}


def retention_spec(suite: str, n_tokens: int, filler: str, doc_questions: int) -> CopySpec | WideSpec:
    """One context's questions: the wide suite's, or the bundled suite's with doc_questions."""
    if suite == "wide":
        return WideSpec(n_tokens, filler)
    return CopySpec(n_tokens, filler, doc_questions)
