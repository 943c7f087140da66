"""The decode worker: one thread that takes requests and decodes them, batched where it can.

- `engine.py`: the thread, its queue and its settings; what the HTTP side submits to.
- `scheduler.py`: the worker's loop, admission, batched and lone cycles, prefill between chunks.
- `jobs.py`: what passes between the HTTP side and the worker.
- `prompt_cache.py`: sessions kept across requests, so a conversation computes only its new tokens.
- `text.py`: streamed text with stop strings held back until decided.

Imports the package below the server (`decoding`, `batching`, `auto`, `proposers`, `targets`,
`platform`), never the HTTP side: the server drives the session, it does not fork the decode loop.
"""
