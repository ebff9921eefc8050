"""`python -m ctxcache.service ARGS`: the `ctxcache` command without its console script (how the
benchmarks start a server: the interpreter that runs them, wherever its scripts are)."""

import sys

from ctxcache.service.cli.main import main

sys.exit(main())
