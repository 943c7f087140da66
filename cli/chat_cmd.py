"""`dflash-mlx chat`: an interactive terminal chat that streams each accepted block as it lands."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mlx_dflash.auto.policy import AUTO, DEFAULT_BLOCK_SIZE, DEFAULT_TREE_BUDGET, DEFAULT_TREE_SHAPE, parse_block_size
from mlx_dflash.errors import DFlashError
from mlx_dflash.platform.files import write_json_atomic

from .app import app
from .calibrate_cmd import block_size_option, calibration_for
from .chat_display import PrefillBar, Stream
from .terminal_input import read_line
from .tree_options import TREE_BUDGET_HELP, TREE_SHAPE_HELP, tree_budget_option, tree_shape_option

DRAFT_STYLE = "cyan"  # tokens the drafter proposed and the target accepted
LOOKUP_STYLE = "green"  # tokens prompt lookup proposed and the target accepted
SOURCE_STYLES = {"dflash": DRAFT_STYLE, "lookup": LOOKUP_STYLE}
TARGET_STYLE = "bold"  # the target's own (bonus or corrected) tokens
PROMPT, MORE = ">>> ", "... "

HELP = """\
/help               this help
/reset              start a new conversation (keeps the system message)
/system TEXT        set the system message (/system alone clears it)
/temp X             sampling temperature (0: greedy)
/top-p X            nucleus sampling (0: off)
/top-k N            sample among the N most likely tokens (0: off)
/min-p X            drop tokens below X times the top token's probability (0: off)
/max-tokens N       most tokens per reply
/block-size auto|N  tokens per draft block: auto (chosen each cycle) or fixed (1: plain decoding)
/tree-budget B [S]  draft trees of B nodes (0: linear blocks; auto: let /block-size auto choose),
                    shaped S: spine (the linear draft plus the likeliest others) or paper
/think on|off       thinking switch of models that have one (e.g. Qwen3)
/color on|off       colour drafted, looked-up and target tokens
/stats              acceptance and block-size histograms, predicted vs measured speed
/save [FILE]        save the conversation with its caches, to go on later without recomputing it
                    (default: the file last saved or loaded, else chat-DATE-TIME.safetensors here);
                    a FILE ending in .json gets the messages and settings as JSON, without caches
/load FILE          go on with a conversation /save wrote (same models; also: chat --resume FILE)
/exit               leave (also Ctrl-D, or Ctrl-C at the prompt)
Multi-line input: end a line with \\ to continue it, or wrap the text in \"\"\" lines.
Ctrl-C while a reply streams stops it; the partial reply stays in the conversation.
Ctrl-C while a long prompt is read (a progress bar) stops it; the message is dropped."""


def _load(console: Console, model: str | None, draft: str | None, no_draft: bool, dtype: str | None,
          quantize: bool, q_bits: int, lookup: bool | None = None) -> tuple[Any, Any, Any, list[str], bool]:
    """Resolve and load the pair; returns (model, tokenizer, drafter, lines describing them, prompt lookup on)."""
    import mlx_dflash
    from mlx_dflash.loading.resolve import choose_pair

    if model is None:
        with console.status("preparing the embedded default model (the first start converts it)"):
            choice = choose_pair(model, draft, no_draft, lookup)
    else:
        choice = choose_pair(model, draft, no_draft, lookup)
    model, draft, source = choice.target, choice.draft, choice.source
    notes = [escape(n) for n in choice.notes] + [f"[yellow]{escape(w)}[/]" for w in choice.warnings]
    quant = None
    if quantize:
        model, quant = _quantized(console, model, q_bits)
    where = "local" if Path(model).expanduser().exists() else "Hugging Face cache or Hub"
    with console.status(escape(f"loading {model}" + (f" and {draft}" if draft else ""))):
        target, tokenizer, drafter = mlx_dflash.load(model, draft, dtype=dtype)
    dtype_name = str(target.model.norm.weight.dtype).replace("mlx.core.", "")
    lines = [
        escape(f"target   {model} ({source}, {where})"),
        escape(f"drafter  {draft if drafter is not None else 'none'}"),
        "lookup   " + ("on (proposals read off the context; --no-lookup turns it off)" if choice.lookup else "off"),
        f"dtype    {dtype_name}" + (f", {quant}" if quant else ""),
        *notes,
    ]
    return target, tokenizer, drafter, lines, choice.lookup


def _quantized(console: Console, model: str, bits: int) -> tuple[str, str]:
    """The target quantized through the converted cache (converted on first use, then reused)."""
    from mlx_dflash.convert import ConvertOptions
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from mlx_dflash.loading.resolve import converted, is_short_name, known_pair

    source = known_pair(model).target if is_short_name(model) else model
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True) as bars:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(f"{bits}-bit conversion: {stage}", total=total or None)
            bars.update(tasks[stage], completed=done, total=total or None)

        path = converted(source, ConvertOptions(quantize=True, q_bits=bits), progress=progress)
    return str(path), f"{bits}-bit quantized (converted cache)"


class ChatUI:
    """The REPL: reads input, dispatches slash commands, renders streaming replies."""

    def __init__(self, console: Console, engine: Any, color: bool, path: Path | None = None):
        self.console = console
        self.engine = engine
        self.color = color
        self.path = path  # the conversation's file: the last saved or loaded (a bare /save writes it)

    # -- input ---------------------------------------------------------------------------
    def read_message(self) -> str | None:
        """One message (possibly multi-line); None on Ctrl-D or Ctrl-C at the prompt.

        Distributed, rank 0 reads the terminal and every other rank receives the same message."""
        world = self.engine.target.world
        if world is None:
            return self._read_terminal()
        with world.waiting():  # a person typing is not a dead rank
            return world.share_text(self._read_terminal() if world.is_main else None)

    def _read_terminal(self) -> str | None:
        try:
            line = read_line(PROMPT)
        except (EOFError, KeyboardInterrupt):
            return None
        if line.strip() == '"""':
            parts = []
            while True:
                try:
                    line = read_line(MORE)
                except EOFError:
                    break
                except KeyboardInterrupt:
                    return ""  # Ctrl-C in a block cancels the message, not the chat
                if line.strip() == '"""':
                    break
                parts.append(line)
            return "\n".join(parts)
        parts = []
        while line.endswith("\\"):
            parts.append(line[:-1])
            try:
                line = read_line(MORE)
            except EOFError:
                break
            except KeyboardInterrupt:
                return ""
        parts.append(line)
        return "\n".join(parts)

    def run(self) -> None:
        while True:
            text = self.read_message()
            if text is None:
                self.console.print()
                return
            if not text.strip():
                continue
            if text.startswith("/"):
                if self.command(text.strip()) == "exit":
                    return
                continue
            try:
                self.reply(text)
            except DFlashError as e:
                self.console.print(f"[red]{escape(str(e))}[/]", highlight=False)

    # -- commands ------------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        s = self.engine.settings
        try:
            if name in ("/exit", "/quit"):
                return "exit"
            elif name == "/help":
                self.console.print(Text(HELP))
            elif name == "/reset":
                self.engine.reset()
                self.console.print("[dim]conversation reset[/]")
            elif name == "/system":
                s.system = arg or None
                self.console.print(f"[dim]system message {'set' if arg else 'cleared'}[/]")
            elif name == "/temp":
                s.temp = _number(arg, float, "/temp", 0.0)
                self.console.print(f"[dim]temperature {s.temp}[/]")
            elif name == "/top-p":
                s.top_p = _number(arg, float, "/top-p", 0.0, 1.0)
                self.console.print(f"[dim]top-p {s.top_p}[/]")
            elif name == "/top-k":
                s.top_k = _number(arg, int, "/top-k", 0)
                self.console.print(f"[dim]top-k {s.top_k}[/]")
            elif name == "/min-p":
                s.min_p = _number(arg, float, "/min-p", 0.0, 1.0)
                self.console.print(f"[dim]min-p {s.min_p}[/]")
            elif name == "/max-tokens":
                s.max_tokens = _number(arg, int, "/max-tokens", 1)
                self.console.print(f"[dim]max tokens {s.max_tokens}[/]")
            elif name == "/block-size":
                self.engine.set_block_size(arg if arg == AUTO else _number(arg, int, "/block-size", 1))
                self.console.print(f"[dim]block size {s.block_size}[/]")
            elif name == "/tree-budget":
                budget, _, shape = arg.partition(" ")
                if not budget:
                    raise DFlashError("/tree-budget needs auto, 0 or a number of nodes (and optionally spine or paper)")
                self.engine.set_trees(budget, shape.strip() or None)
                self.console.print(f"[dim]{_trees(s)}[/]")
            elif name == "/think":
                s.think = _switch(arg, "/think")
                self.console.print(f"[dim]thinking {'on' if s.think else 'off'}[/]")
            elif name == "/color":
                self.color = _switch(arg, "/color")
                self.console.print(f"[dim]colours {'on' if self.color else 'off'}[/]")
            elif name == "/stats":
                self.stats()
            elif name == "/save":
                self.save(arg)
            elif name == "/load":
                self.load(arg)
            else:
                self.console.print(f"[red]unknown command {escape(name)}: /help lists them[/]", highlight=False)
        except DFlashError as e:
            self.console.print(f"[red]{escape(str(e))}[/]", highlight=False)
        return None

    def stats(self) -> None:
        t = self.engine.totals
        used, limit = self.engine.context_used(), self.engine.max_context
        self.console.print(
            f"{t.turns} turns, {t.prompt_tokens} prompt tokens computed, {t.generated_tokens} generated, "
            f"tau {t.tau:.2f} over {len(t.acceptance_lengths)} cycles; context {used}"
            + (f" of {limit}" if limit else "") + " tokens", highlight=False,
        )
        hist = t.histogram
        if not t.acceptance_lengths:
            return
        table = Table("tokens/cycle", "cycles", "", box=None, pad_edge=False)
        top = max(hist)
        for n, count in enumerate(hist):
            if n and count:
                table.add_row(str(n), str(count), "#" * max(1, round(30 * count / top)))
        self.console.print(table)
        sizes = t.block_size_histogram
        table = Table("block size", "cycles", "", box=None, pad_edge=False)
        for size, count in sizes.items():
            table.add_row(str(size) + (" (plain)" if size == 1 else ""), str(count),
                          "#" * max(1, round(30 * count / max(sizes.values()))))
        self.console.print(table)
        trees = [n for n in t.tree_sizes if n]
        if trees:
            self.console.print(f"draft trees: {len(trees)} of {len(t.tree_sizes)} cycles, up to {max(trees)} nodes",
                               highlight=False)
        if t.accepted_by_source:
            self.console.print("accepted proposed tokens: " + ", ".join(
                f"{n} {source}" for source, n in sorted(t.accepted_by_source.items())), highlight=False)
        if t.predicted_tps is not None:
            self.console.print(f"cost model: predicted {t.predicted_tps:.1f} tok/s, measured {t.measured_tps:.1f} "
                               "tok/s (decode)", highlight=False)

    def save(self, arg: str) -> None:
        """The conversation with its caches (a file `load` reads), or as JSON to a .json file."""
        if arg.lower().endswith(".json"):
            self.save_json(arg)
            return
        path = Path(arg).expanduser() if arg else self.path or _new_chat_path()
        with self.console.status(escape(f"saving to {path}")):
            size = self.engine.save(path)
        self.path = path
        self.console.print(
            f"[dim]saved {len(self.engine.messages)} messages and their caches "
            f"({self.engine.context_used()} tokens, {_size(size)}) to {escape(str(path))}; "
            f"/load it or chat --resume it to go on[/]", highlight=False, soft_wrap=True)  # a path to copy whole

    def load(self, arg: str) -> None:
        if not arg:
            raise DFlashError("/load needs a file name")
        if arg.lower().endswith(".json"):
            raise DFlashError(f"{arg}: a JSON transcript has no caches; /load reads what /save FILE writes "
                              "(a name not ending in .json)")
        path = Path(arg).expanduser()
        with self.console.status(escape(f"loading {path}")):
            self.engine.load(path)
        self.path = path
        self.console.print(f"[dim]{_loaded(self.engine, path)}[/]", highlight=False, soft_wrap=True)

    def save_json(self, path: str) -> None:
        data = {
            "messages": self.engine.conversation(),
            "settings": asdict(self.engine.settings),
            "acceptance_lengths": self.engine.totals.acceptance_lengths,
            "tree_sizes": self.engine.totals.tree_sizes,
        }
        try:
            if self.engine.target.world is None or self.engine.target.world.is_main:  # rank 0 writes
                write_json_atomic(Path(path).expanduser(), data, indent=2, ensure_ascii=False)
        except OSError as e:
            raise DFlashError(f"cannot write {path}: {e.strerror}") from None
        self.console.print(f"[dim]saved {len(data['messages'])} messages to {escape(path)}[/]", highlight=False)

    # -- a reply -------------------------------------------------------------------------
    def reply(self, text: str) -> None:
        engine = self.engine
        turn = engine.send(text)
        live: Stream | None = None
        bar = PrefillBar(self.console) if self.console.is_terminal else None
        engine.on_prefill = bar.update if bar is not None else None
        previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, lambda *_: engine.request_stop())  # stop at the cycle's (or chunk's) end
        start = time.perf_counter()
        try:
            while True:
                try:
                    chunk = next(turn)
                except StopIteration as done:
                    result = done.value
                    break
                if live is None and self.console.is_terminal:  # after the prefill's bar: one live display at a time
                    bar.close()
                    live = Stream(self.console)
                piece = Text()
                piece.append(chunk.draft_text, SOURCE_STYLES.get(chunk.source, DRAFT_STYLE) if self.color else "")
                piece.append(chunk.target_text, TARGET_STYLE if self.color else "")
                st = chunk.event.stats
                status = (f"{st.num_tokens} tok · {st.num_tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s"
                          f" · tau {st.tau:.2f} · {st.cycles} cycles · Ctrl-C stops")
                if live:
                    live.add(piece, status)
                else:
                    self.console.print(piece, end="")
        finally:
            signal.signal(signal.SIGINT, previous)
            engine.on_prefill = None
            if bar is not None:
                bar.close()
            if live:
                live.close()
        self.console.print()
        st = result.stats
        tail = {"stop": "", "length": " · stopped at the token limit", "interrupted": " · interrupted"}
        plain = f" ({st.plain_cycles} plain step{'s' * (st.plain_cycles > 1)})" if st.plain_cycles else ""
        self.console.print(
            f"[dim]{st.num_tokens} tokens · {st.generation_tps:.1f} tok/s · tau {st.tau:.2f} · "
            f"{st.cycles} cycles{plain} · prefill {result.new_tokens} new tokens ({result.reused_tokens} cached) "
            f"in {st.prefill_time:.2f} s{tail[result.finish_reason]}[/]", highlight=False,
        )


def _new_chat_path() -> Path:
    """chat-DATE-TIME.safetensors in the current directory (a name not taken yet)."""
    stem = time.strftime("chat-%Y%m%d-%H%M%S")
    path, n = Path.cwd() / f"{stem}.safetensors", 1
    while path.exists():
        n += 1
        path = Path.cwd() / f"{stem}-{n}.safetensors"
    return path


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _loaded(engine: Any, path: Path) -> str:
    """What a loaded conversation holds, in one line."""
    return f"loaded {len(engine.messages)} messages ({engine.context_used()} tokens cached) from {escape(str(path))}"


def _number(arg: str, kind: type, name: str, low: float, high: float | None = None) -> Any:
    try:
        value = kind(arg)
    except ValueError:
        raise DFlashError(f"{name} needs a {'whole ' if kind is int else ''}number, got {arg!r}") from None
    if value < low or (high is not None and value > high):
        raise DFlashError(f"{name} must be {'between ' + str(low) + ' and ' + str(high) if high else '>= ' + str(low)}")
    return value


def _switch(arg: str, name: str) -> bool:
    if arg not in ("on", "off"):
        raise DFlashError(f"{name} takes on or off")
    return arg == "on"


def _history(console: Console) -> None:
    """Input history and line editing (readline, where the platform has it), kept across sessions."""
    try:
        import readline
    except ImportError:
        return
    path = Path(os.environ.get("DFLASH_MLX_HISTORY", "~/.cache/mlx-dflash/chat_history")).expanduser()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    import atexit

    def write() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    atexit.register(write)


@app.command()
def chat(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Target: short name, Hugging Face repo id or mlx-lm directory (default: the embedded SmolLM2-135M-Instruct).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="DFlash drafter: directory or repo id.")] = None,
    quantize: Annotated[bool, typer.Option("--quantize", "-q", help="Quantize the target (see --q-bits).")] = False,
    q_bits: Annotated[int | None, typer.Option("--q-bits", min=2, max=8, help="Bits per weight when quantizing (default 4; implies --quantize).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 | float16 | bfloat16 (default: float32 on the CPU).")] = None,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Sampling temperature (0: greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling (0: off).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Top-k sampling (0: off).")] = 0,
    min_p: Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Min-p sampling (0: off).")] = 0.0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Most tokens per reply.")] = 1024,
    block_size: Annotated[str, typer.Option("--block-size", callback=block_size_option, help="Tokens per draft block: auto (chosen each cycle for the most tokens per second on this machine; the output is the same either way) or a fixed N (1: plain decoding).")] = DEFAULT_BLOCK_SIZE,
    tree_budget: Annotated[str, typer.Option("--tree-budget", callback=tree_budget_option, help=TREE_BUDGET_HELP)] = str(DEFAULT_TREE_BUDGET),
    tree_shape: Annotated[str, typer.Option("--tree-shape", callback=tree_shape_option, help=TREE_SHAPE_HELP)] = DEFAULT_TREE_SHAPE,
    system: Annotated[str | None, typer.Option("--system", help="System message.")] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Decode with the target alone (to feel the difference).")] = False,
    no_color: Annotated[bool, typer.Option("--no-color", help="No colours (drafted and target tokens look alike).")] = False,
    lookup: Annotated[bool | None, typer.Option("--lookup/--no-lookup", help="Prompt lookup: also verify tokens read off the conversation, when auto expects them to pay (default: on, off with --no-draft).")] = None,
    resume: Annotated[str | None, typer.Option("--resume", help="Go on with a conversation /save wrote (its messages, settings and caches: nothing is recomputed). Needs the same target and drafter; options given here override its saved settings.")] = None,
) -> None:
    """Chat with a model in the terminal; each accepted draft block appears at once.

    Drafted tokens the target accepted are shown in cyan, tokens prompt lookup proposed and the
    target accepted in green, the target's own tokens in bold.
    Type /help in the chat for its commands.
    """
    from mlx_dflash.chat import ChatEngine, ChatSettings

    console = Console(no_color=no_color or None, highlight=False)
    target, tokenizer, drafter, lines, prompt_lookup = _load(console, model, draft, no_draft, dtype,
                                                             quantize or q_bits is not None, q_bits or 4, lookup)
    size = parse_block_size(block_size)
    settings = ChatSettings(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens,
                            block_size=size, tree_budget=tree_budget, tree_shape=tree_shape, system=system)
    calibration = calibration_for(target, drafter, size, trees=str(tree_budget).strip().lower() == AUTO)
    engine = ChatEngine(target, tokenizer, drafter, settings, calibration=calibration, prompt_lookup=prompt_lookup)
    for line in lines:
        console.print(line, highlight=False)
    if resume is not None:
        with console.status(escape(f"loading {resume}")):
            engine.load(Path(resume).expanduser())
        _override(ctx, engine, settings)
        console.print(f"[dim]{_loaded(engine, Path(resume))}[/]", highlight=False, soft_wrap=True)
    legend = Text.assemble(("drafted", DRAFT_STYLE), " / ", ("looked up", LOOKUP_STYLE), " / ",
                           ("target", TARGET_STYLE)) if not no_color else ""
    console.print(Text.assemble(
        f"block size {engine.settings.block_size}, {_trees(engine.settings)}, context {engine.max_context or 'unbounded'} tokens; ",
        legend, " · /help for commands, Ctrl-D to leave",
    ), highlight=False)
    if console.is_terminal:
        _history(console)
    ChatUI(console, engine, color=not no_color, path=Path(resume).expanduser() if resume else None).run()


def _override(ctx: typer.Context, engine: Any, given: Any) -> None:
    """The options given on the command line replace a resumed conversation's saved settings."""

    def set_here(name: str) -> bool:
        source = ctx.get_parameter_source(name)  # (by name: Typer may carry its own copy of Click's enum)
        return source is not None and source.name != "DEFAULT"

    for name in ("temp", "top_p", "top_k", "min_p", "max_tokens", "system"):
        if set_here(name):
            setattr(engine.settings, name, getattr(given, name))
    if set_here("block_size"):
        engine.set_block_size(given.block_size)
    if set_here("tree_budget") or set_here("tree_shape"):
        engine.set_trees(given.tree_budget if set_here("tree_budget") else engine.settings.tree_budget,
                         given.tree_shape if set_here("tree_shape") else None)


def _trees(settings: Any) -> str:
    """'linear blocks', 'draft trees of 32 nodes (spine)' or 'draft trees auto (spine)'."""
    budget = settings.tree_budget
    if budget == 0:
        return "linear blocks"
    return f"draft trees {'of ' + str(budget) + ' nodes' if budget != AUTO else 'auto'} ({settings.tree_shape})"
