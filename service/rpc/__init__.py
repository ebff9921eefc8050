"""The gRPC front: `servicer.py` (ContextService: put, get, generate, delete, list),
`admin.py` (AdminService on the admin port), `calls.py` (the wrapper every call runs in: status
codes, deadlines, worker threads; the event loop thread and the request-parsing interceptor),
`access_log.py` (one line per call)."""
