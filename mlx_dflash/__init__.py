"""mlx-dflash: DFlash block-diffusion speculative decoding for MLX.

The top level is the public API: `load`, `load_drafter`, `generate`, `stream_generate`
(`generate.py`), the multi-turn `chat.ChatEngine`, `save_session` / `load_session` (a
session's caches in a file, `decoding.session_file`) and the `doctor`'s checks. `session`,
`policy` and `calibration` are the documented paths of `decoding.session`, `auto.policy`
and `auto.calibration`, re-exported. Everything else lives in one subpackage per concern,
each importing only the ones listed below it:

    server/      `dflash-mlx serve`: HTTP edge, the three APIs, reply reading, the decode worker
    bench/ train/  `dflash-mlx bench` and `dflash-mlx train`
    (this level) the public API: generate.py, chat.py, doctor.py
    batching/    several sessions in one draft and one verify forward, and their ragged caches
    auto/        `--block-size auto`: the policy, its estimators, calibration, the acceptance memory, tree budgets
    decoding/    the decode loop, the session, one speculative step and its acceptance rule, sampling, trees
    loading/     short names, the Hub, the converted cache, `load`
    convert/     checkpoints to MLX directories, and building a model from its config
    proposers/   who proposes tokens: DFlash, DFlash2, prompt lookup, the rank follower, one factory
    drafters/    the draft models, their context K/V injection and draft cache, the pairing check
    targets/     the target's forward with captured hidden states, per family; the tree pass; dtypes
    distributed/ ranks over `mx.distributed`: the world, start-up agreement, fingerprints
    kernels/     the Metal kernels of the K/V injection, each beside its pure-MLX twin
    platform/    what must precede MLX (OpenBLAS), the runtime (streams, wired memory), files
"""

from .platform.setup import setup as _setup_platform
from .version import __version__ as __version__

_setup_platform()  # must precede the first `import mlx.core` (Linux OpenBLAS)

try:
    from .decoding.loop import GenerationEvent
    from .decoding.session_file import SessionFileError, load_session, save_session
    from .decoding.stats import GenerationStats
    from .drafters.dflash import DFlashDraftModel, ModelArgs
    from .drafters.dflash2 import DFlash2DraftModel
    from .drafters.pairing import check_compatible
    from .errors import DFlashError, IncompatibleDrafterError
    from .generate import generate, stream_generate
    from .loading.loaders import load, load_drafter
    from .targets.model import TargetModel, supported_model_types
except ModuleNotFoundError as e:  # the PyTorch trainer imports the framework-free modules where MLX is absent
    if (e.name or "").split(".")[0] != "mlx":
        raise

__all__ = [
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "DFlashError",
    "GenerationEvent",
    "GenerationStats",
    "IncompatibleDrafterError",
    "ModelArgs",
    "SessionFileError",
    "TargetModel",
    "check_compatible",
    "generate",
    "load",
    "load_drafter",
    "load_session",
    "save_session",
    "stream_generate",
    "supported_model_types",
]
