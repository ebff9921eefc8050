"""Package discovery for the design card's layout.

The repository keeps its top level (service/ indexer/ store/ decoder/ ...) while everything
installs under the `ctxcache` namespace. pyproject.toml holds the metadata; this file only
maps folders to packages and discovers subpackages, so adding one needs no edit here.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "ctxcache": "ctxcache",
    "ctxcache.client": "client",
    "ctxcache.service": "service",
    "ctxcache.indexer": "indexer",
    "ctxcache.store": "store",
    "ctxcache.decoder": "decoder",
    "ctxcache.quality": "quality",
    "ctxcache.bench": "bench",
}


# folders of data files only (no __init__.py): Python imports them as namespace packages, so
# setuptools wants them named, or it warns that they are missing from `packages`
DATA_PACKAGES = ["ctxcache.quality.corpus"]


def discover() -> list[str]:
    found = list(DATA_PACKAGES)
    for name, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder).parts
            found.append(".".join((name, *rel)))
    return found


setup(packages=discover(), package_dir=ROOTS)
