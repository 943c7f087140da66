"""Print the shell lines of a marked README block (`<!-- NAME ... -->` ... `<!-- /NAME -->`), comments removed.

CI runs these lines as printed, so the README's install and test commands cannot drift from what CI proves.
Running as root on a machine without sudo, a leading `sudo ` is dropped (as a root user would type it).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path


def block_lines(readme: str, name: str) -> list[str]:
    match = re.search(rf"<!-- {re.escape(name)}\b[^>]*-->\s*```[^\n]*\n(.*?)```\s*<!-- /{re.escape(name)} -->",
                      readme, re.S)
    if match is None:
        raise SystemExit(f"README has no block marked <!-- {name} -->")
    lines = []
    for line in match.group(1).splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment after two or more spaces
        if command and not command.startswith("#"):
            lines.append(command)
    return lines


def main() -> None:
    name = sys.argv[1]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    drop_sudo = os.geteuid() == 0 and shutil.which("sudo") is None
    for line in block_lines(readme, name):
        print(line.replace("sudo ", "") if drop_sudo else line)


if __name__ == "__main__":
    main()
