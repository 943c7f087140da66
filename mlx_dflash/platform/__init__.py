"""What every other part stands on: set-up that must precede MLX, the runtime, the project's files.

- `setup.py`: on Linux, the system OpenBLAS loaded before `mlx.core` (the package's first act);
  a one-line description of this machine.
- `runtime.py`: the generation stream, the wired-memory limit, memory sizing, what threads respect.
- `files.py`: the cache folder, and JSON written atomically.

Imports nothing else of the package; this `__init__` imports nothing at all, so that `setup`
runs before MLX is first imported.
"""
