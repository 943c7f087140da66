"""The documented path of `DecodingSession` (README: Python API): the decode state lives in
`mlx_dflash.decoding.session`; this module only re-exports it."""

from .decoding.session import DecodingSession, PrefillCancelled

__all__ = ["DecodingSession", "PrefillCancelled"]
