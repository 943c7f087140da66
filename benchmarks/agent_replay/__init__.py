"""The parts of bench_agent_replay.py: recording real agents' requests and deriving shapes.json (capture),
requests synthesized to those shapes (synth), the streamed client (client), the `dflash-mlx serve` subprocess
(server), the targets' model folders (targets), the phases against one target (replay), the report (report)."""
