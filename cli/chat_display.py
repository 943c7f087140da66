"""The chat's live terminal areas: a long prompt's progress bar, then the streaming reply.

Rich shows one live display at a time: the bar closes before the reply's area opens.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

PREFILL_BAR_TOKENS = 2048  # prompts computing more positions than this show a progress bar


class PrefillBar:
    """A transient progress bar while a long prompt is prefilled (the engine tells `update`
    before its first chunk and after each); prompts of up to `PREFILL_BAR_TOKENS` show none."""

    def __init__(self, console: Console):
        self.console = console
        self.bars: Progress | None = None
        self.task: Any = None

    def update(self, fed: int, total: int) -> None:
        if self.bars is None:
            if total <= PREFILL_BAR_TOKENS or fed >= total:
                return
            self.bars = Progress(TextColumn("reading the prompt"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tokens"), TimeElapsedColumn(), TextColumn("[dim]Ctrl-C stops"),
                                 console=self.console, transient=True)
            self.bars.start()
            self.task = self.bars.add_task("prefill", total=total)
        self.bars.update(self.task, completed=fed, total=total)
        if fed >= total:
            self.close()

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None


class Stream:
    """Live area: the reply's unfinished last row plus a status line; finished rows scroll up."""

    def __init__(self, console: Console):
        self.console = console
        self.current = Text()
        self.status = ""
        self.live = Live(console=console, refresh_per_second=12, transient=True)
        self.live.start()

    def add(self, piece: Text, status: str) -> None:
        self.current.append_text(piece)
        self.status = status
        rows = self.current.wrap(self.console, max(self.console.width, 1), overflow="fold")
        for row in rows[:-1]:
            self.live.console.print(row, soft_wrap=True)
        self.current = rows[-1] if len(rows) else Text()
        if self.current.plain.endswith("\n"):  # wrap keeps no empty last row for a trailing newline
            self.current = Text()
        self.live.update(Group(self.current, Text(self.status, style="dim")))

    def close(self) -> None:
        self.live.stop()
        self.console.print(self.current, end="")
