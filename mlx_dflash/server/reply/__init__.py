"""Reading a reply: answer text, reasoning and tool calls in the model's own format; structured output.

- `parser.py`: the model's format (`ReplyFormat`) and `ReplyParser`, one per request.
- `readers.py`: the family readers the parser drives; `events.py`: what they yield.
- `structured.py`: a request's response format or forced tool call as a grammar to decode by.
- `tools.py`: earlier tool calls as chat templates expect them.

Imports `http` (fields, errors, state), `worker` and `mlx_dflash.decoding.constraint`.
"""
