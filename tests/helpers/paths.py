"""Where the tests find the repository's own files, and the shared evaluation data beside the checkout."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: pyproject.toml, README.md, docs/, .ci/
TESTS = REPO / "tests"
SHARED_DATA = REPO.parent / "shared" / "data"  # ../shared/data (its README says what each file is)
