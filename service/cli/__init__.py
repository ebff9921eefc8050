"""The `ctxcache` command line, one front of the service: `main.py` parses the flags (the
console script's entry point), `commands.py` does each subcommand, `client.py` and `admin.py`
are the client commands (no torch), `records.py` prints their records, `errors.py` turns a
failure into one line for the terminal."""
