"""`dflash-mlx chat`: /save and /load of a conversation with its caches, --resume, the errors that do
not end the chat, and the progress bar of a long prompt."""

from __future__ import annotations

import io
import json
import re

from mlx_dflash.cli import chat_display
from mlx_dflash.cli.chat_cmd import ChatUI
from mlx_dflash.cli.main import _register, app
from rich.console import Console
from typer.testing import CliRunner

import mlx_dflash
from mlx_dflash.chat import ChatEngine, ChatSettings
from mlx_dflash.decoding import session as session_module
from mlx_dflash.decoding.session_file import read_header
from mlx_dflash.errors import DFlashError

_register()
SUMMARY = re.compile(r"(\d+) tokens · [\d.]+ tok/s · .*? · prefill (\d+) new tokens \((\d+) cached\)")


def chat(pair, script: str, *options: str):
    target, drafter = pair
    return CliRunner().invoke(app, ["chat", "--model", target, "--draft", drafter, *options], input=script)


def flat(output: str) -> str:
    return " ".join(output.split())


def summaries(output: str) -> list[tuple[int, int, int]]:
    """(generated, new prompt tokens, cached tokens) of each reply's summary line."""
    return [tuple(map(int, m)) for m in SUMMARY.findall(flat(output))]


def messages(path) -> list[dict]:
    return json.loads(path.read_text())["messages"]


def test_save_then_resume_or_load_goes_on_as_if_never_saved(pair, tmp_path):
    saved, never, resumed, loaded = (tmp_path / name for name in ("c.safetensors", "n.json", "r.json", "l.json"))
    first = chat(pair, f"hello there\n/save {saved}\n", "--max-tokens", "12", "--system", "be kind")
    assert first.exit_code == 0, first.output
    assert saved.exists() and re.search(rf"saved 2 messages and their caches \(\d+ tokens, [\d.]+ kB\) to {saved}",
                                        flat(first.output))
    unsaved = chat(pair, f"hello there\nand now?\n/save {never}\n", "--max-tokens", "12", "--system", "be kind")
    # Resumed, the saved settings come back (the system message too); the next turn computes only itself.
    again = chat(pair, f"and now?\n/save {resumed}\n", "--resume", str(saved))
    assert again.exit_code == 0, again.output
    out = flat(again.output)
    assert re.search(rf"loaded 2 messages \((\d+) tokens cached\) from {saved}", out)
    assert messages(resumed) == messages(never)
    (_, new, cached), = summaries(again.output)
    assert summaries(again.output)[0] == summaries(unsaved.output)[1] and cached > new
    assert new <= len("</s><u>and now?</s><a>") - 6  # "</s>" is one token (two: the first reply ran out)
    # /load in a running chat replaces its conversation; a bare /save then writes the loaded file.
    script = f"something else\n/load {saved}\nand now?\n/save {loaded}\n/save\n"
    later = chat(pair, script, "--max-tokens", "12")
    assert later.exit_code == 0, later.output
    assert messages(loaded) == messages(never)
    assert "saved 4 messages and their caches" in flat(later.output) and str(saved) in flat(later.output)
    assert read_header(saved).metadata["messages"] == messages(never)[1:]  # the system message is a setting


def test_options_given_with_resume_replace_the_saved_ones(pair, tmp_path):
    saved = tmp_path / "c.safetensors"
    assert chat(pair, f"hello there\n/save {saved}\n", "--max-tokens", "12").exit_code == 0
    result = chat(pair, f"and now?\n/save {tmp_path / 'r.json'}\n", "--resume", str(saved), "--max-tokens", "3",
                  "--block-size", "4")
    assert result.exit_code == 0, result.output
    assert summaries(result.output)[0][0] == 3
    settings = json.loads((tmp_path / "r.json").read_text())["settings"]
    assert settings["max_tokens"] == 3 and settings["block_size"] == 4 and settings["temp"] == 0.0


def test_a_bare_save_names_a_new_file_here(pair, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = chat(pair, "hello\n/save\n/save\n", "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    files = list(tmp_path.glob("chat-*.safetensors"))
    assert len(files) == 1 and flat(result.output).count(f"to {files[0]}") == 2  # then the same file again


def test_errors_are_one_line_and_the_chat_goes_on(pair, tmp_path):
    saved, garbage = tmp_path / "c.safetensors", tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    assert chat(pair, f"hello\n/save {saved}\n", "--max-tokens", "4").exit_code == 0
    script = "\n".join(["/load", f"/load {tmp_path / 'missing'}", f"/load {garbage}", f"/load {tmp_path / 'x.json'}",
                        "still here", f"/save {garbage}/x.safetensors", "/help"]) + "\n"
    result = chat(pair, script, "--max-tokens", "4")
    out = flat(result.output)
    assert result.exit_code == 0, result.output
    for line in ["/load needs a file name", "missing: no such file", "not a session file this version can read",
                 "a JSON transcript has no caches", "cannot write", "/save [FILE]", "/load FILE"]:
        assert line in out, line
    assert len(summaries(result.output)) == 1  # the message after the errors got its reply
    # Other models: --resume refuses before the chat starts, naming why.
    other = chat(pair, "", "--resume", str(saved), "--no-draft")
    assert isinstance(other.exception, DFlashError) and "saved with a drafter" in str(other.exception)
    missing = chat(pair, "", "--resume", str(tmp_path / "missing"))
    assert isinstance(missing.exception, DFlashError) and "no such file" in str(missing.exception)


def test_help_explains_resume(pair):
    result = CliRunner().invoke(app, ["chat", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--resume" in result.output and "/save wrote" in flat(result.output)


def test_a_long_prompt_shows_a_progress_bar_in_a_terminal(pair, monkeypatch):
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(chat_display, "PREFILL_BAR_TOKENS", 40)
    target, tokenizer, drafter = mlx_dflash.load(pair[0], pair[1])
    engine = ChatEngine(target, tokenizer, drafter, ChatSettings(max_tokens=4))
    for text, shown in (("short", False), ("a long question, " * 6, True)):
        screen = io.StringIO()
        ui = ChatUI(Console(file=screen, force_terminal=True, width=120), engine, color=False)
        ui.reply(text)
        assert ("reading the prompt" in screen.getvalue()) == shown
        assert engine.on_prefill is None  # set for the turn only
