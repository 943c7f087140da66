"""`dflash-mlx convert`: a checkpoint (directory, Hub repo, .gguf or short name) -> MLX directories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mlx_dflash.errors import DFlashError

from .app import app, err_console

STAGES = {"download": "downloading", "read": "reading", "quantize": "quantizing", "write": "writing"}


class _Bars:
    """Renders the library's (stage, done, total) callbacks as Rich progress bars."""

    def __init__(self, progress: Progress, label: str):
        self.progress, self.label, self.tasks = progress, label, {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(f"{self.label} {STAGES.get(stage, stage)}", total=total or None)
        self.progress.update(self.tasks[stage], completed=done, total=total or None)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Local directory, .gguf file, Hugging Face repo id, or a short name (see `dflash-mlx models`).")],
    dst: Annotated[Path, typer.Argument(help="Output directory (for a short name: DST/target and DST/drafter).")],
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 | float16 | bfloat16 (default: keep the checkpoint's).")] = None,
    quantize: Annotated[bool, typer.Option("--quantize", "-q", help="Quantize the weights.")] = False,
    q_bits: Annotated[int, typer.Option("--q-bits", help="Bits per weight: 2, 3, 4, 6 or 8.")] = 4,
    q_group_size: Annotated[int, typer.Option("--q-group-size", help="Quantization group size: 32, 64 or 128.")] = 64,
    q_recipe: Annotated[str, typer.Option("--q-recipe", help="mixed (drafter fc unquantized, embedding/lm_head at 8 bit) or uniform.")] = "mixed",
    dequantize: Annotated[bool, typer.Option("--dequantize", help="Store packed GGUF/quantized weights as plain floats (faster on a CPU).")] = False,
    draft_quantize: Annotated[bool | None, typer.Option("--draft-quantize/--no-draft-quantize", help="Short names: quantize the drafter too (default: as -q).")] = None,
    target: Annotated[str | None, typer.Option("--target", help="Drafter conversions: check it against this target directory or .gguf first.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite DST if it exists.")] = False,
    offline: Annotated[bool, typer.Option("--offline", help="Use only the local Hugging Face cache (also HF_HUB_OFFLINE=1).")] = False,
    revision: Annotated[str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit).")] = None,
) -> None:
    """Convert a PyTorch, safetensors or GGUF checkpoint (target or DFlash drafter) to MLX."""
    from mlx_dflash.convert import ConvertOptions
    from mlx_dflash.convert import convert as run_convert

    from mlx_dflash.loading.resolve import download, is_short_name, known_pair

    options = ConvertOptions(dtype=dtype, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size,
                             q_recipe=q_recipe, dequantize=dequantize)
    options.validate()
    with _progress() as bars:
        if is_short_name(src):
            pair = known_pair(src)
            draft_options = options if draft_quantize is None else ConvertOptions(
                dtype=dtype, quantize=draft_quantize, q_bits=q_bits, q_group_size=q_group_size, q_recipe=q_recipe)
            jobs = [("target", pair.target, dst / "target", options, None),
                    ("drafter", pair.drafter, dst / "drafter", draft_options, dst / "target")]
            for _, _, out, _, _ in jobs:
                if out.exists() and not force:
                    raise DFlashError(f"{out} already exists; pass --force to overwrite it")
        else:
            jobs = [("model", src, dst, options, target)]
        for label, source, out, opts, check_against in jobs:
            path = Path(source).expanduser()
            info = None
            if not path.exists():
                path = download(str(source), revision=revision, offline_only=offline, progress=_Bars(bars, label))
                info = {"source": str(source), "revision": path.name}
            result = run_convert(path, out, opts, force=force, target=check_against, provenance=info,
                                 progress=_Bars(bars, label))
            err_console.print(f"[green]wrote[/] {result.kind} to {escape(str(result.path))}", highlight=False)
