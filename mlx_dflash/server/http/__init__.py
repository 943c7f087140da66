"""The HTTP edge: what every request passes before and after a route handles it.

- `guard.py`: the checks before a route reads a request (origin, media type, size, nesting).
- `fields.py`: typed reads of request fields, each wrong one a 400 that names it.
- `errors.py`: `APIError`, which each API renders in its own shape.
- `sse.py`: server-sent events framing and keep-alives.
- `state.py`: what every route shares: the engine, the served model, prompt rendering.

Imports the `worker` (a route submits jobs to the engine) and nothing above it.
"""
