"""The service: the fronts and their wiring. gRPC (rpc/), the OpenAI-compatible HTTP front
(http/), the command line (cli/); the server that assembles them from the config (server.py,
assembly.py, config.py), the roles of a fleet (roles.py), auth, requests to domain objects
(convert.py), the seam onto the store and the registry (backend.py, fleet_backend.py), warm-up and
the in-process local mode. The work is the rooms': indexer/, decoder/, store/."""
