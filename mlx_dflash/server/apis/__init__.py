"""The three APIs a client may speak, each request to a job and a job's events to replies.

- `openai_api.py`: chat/completions and completions.
- `anthropic_api.py`: Messages and count_tokens, as Claude Code sends them.
- `responses_api.py`, `responses_output.py`: OpenAI Responses, as Codex speaks it.

Imports `reply` (reading the model's output), `http` and `worker`.
"""
