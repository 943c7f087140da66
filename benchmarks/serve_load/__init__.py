"""The parts of bench_serve_load.py: the server's child process, its clients, the hostile prober, the report."""
