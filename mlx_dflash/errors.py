"""Errors a user can act on: one clear sentence, shown by the CLI without a traceback."""


class DFlashError(ValueError):
    """Bad input, incompatible models, or missing files."""


class IncompatibleDrafterError(DFlashError):
    """The drafter was not trained for this target (sizes, vocabulary or layers disagree)."""
