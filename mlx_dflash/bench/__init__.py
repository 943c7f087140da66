"""`dflash-mlx bench`: DFlash against the target alone on the paper's five benchmarks."""

from .datasets import DATASETS, Prompt, load_prompts
from .document import SCHEMA_VERSION, build_document
from .engines import DFlashEngine, Engine, MlxLmEngine, Run
from .runner import BenchConfig, BenchResult, Record, run_bench
from .stats import summarize

__all__ = [
    "DATASETS",
    "SCHEMA_VERSION",
    "BenchConfig",
    "BenchResult",
    "DFlashEngine",
    "Engine",
    "MlxLmEngine",
    "Prompt",
    "Record",
    "Run",
    "build_document",
    "load_prompts",
    "run_bench",
    "summarize",
]
