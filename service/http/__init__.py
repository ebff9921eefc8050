"""The OpenAI-compatible HTTP front: chat and text completions over cached contexts (by
reference or found automatically from the leading messages) and the cache resource in Gemini's
shape. protocol.py (request bodies), generation.py and cached.py (handlers, no web framework),
app.py (routes), middleware.py (tokens, body size, metrics), errors.py (the one error shape),
front.py (uvicorn in the server's process)."""
