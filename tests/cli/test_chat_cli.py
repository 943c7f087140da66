"""`dflash-mlx chat`: options and slash commands (CliRunner), and a real pseudo-terminal session."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.tiny import EOS_ID, drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

from mlx_dflash.errors import DFlashError

_register()
CLI = [sys.executable, "-c", "from mlx_dflash.cli.main import main; main()"]  # what the dflash-mlx script runs
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]|\x1b\][^\x07]*\x07|\r")
SUMMARY = re.compile(
    r"(\d+) tokens · [\d.]+ tok/s · tau [\d.]+ · \d+ cycles(?: \(\d+ plain steps?\))? · "
    r"prefill (\d+) new tokens \((\d+) cached\)"
)


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """A target that never ends a reply by itself (its end-of-sequence row is zero), with a long context."""
    root = tmp_path_factory.mktemp("endless")
    model = tiny_target("qwen3", seed=0)
    weight = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = mx.where(mx.arange(weight.shape[0])[:, None] == EOS_ID, 0.0, weight)
    target = save_target(model, "qwen3", root / "target")
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 1_000_000
    (target / "config.json").write_text(json.dumps(config))
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), root / "drafter")
    return str(target), str(drafter)


def chat(pair, script: str, *options: str):
    target, drafter = pair
    return CliRunner().invoke(app, ["chat", "--model", target, "--draft", drafter, *options], input=script)


def summaries(output: str) -> list[tuple[int, int, int]]:
    """(generated, new prompt tokens, cached tokens) of each reply's summary line."""
    return [tuple(map(int, m)) for m in SUMMARY.findall(" ".join(output.split()))]


def test_a_message_streams_a_reply_and_a_summary(pair):
    result = chat(pair, "hello there\nand now?\n", "--max-tokens", "12")
    assert result.exit_code == 0, result.output
    assert "target" in result.output and "drafter" in result.output and "float32" in result.output
    (n1, new1, cached1), (n2, new2, cached2) = summaries(result.output)
    assert n1 == n2 == 12 and cached1 == 0 and new1 == len("<u>hello there</s><a>") - 3
    assert cached2 == new1 + n1  # turn 2 reused the whole first turn
    assert new2 == len("</s><u>and now?</s><a>") - 6  # two "</s>" are one token each


def test_options_are_parsed_and_checked(pair, tmp_path):
    save = tmp_path / "c.json"
    result = chat(pair, f"hi\n/save {save}\n", "--temp", "0.7", "--top-p", "0.9", "--max-tokens", "3",
                  "--block-size", "4", "--system", "be kind", "--no-color")
    assert result.exit_code == 0, result.output
    data = json.loads(save.read_text())
    assert data["settings"] == {"temp": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "max_tokens": 3,
                                "block_size": 4, "tree_budget": 0, "tree_shape": "spine", "think": None,
                                "system": "be kind"}
    assert data["messages"][0] == {"role": "system", "content": "be kind"}
    assert "\x1b[" not in result.output
    assert 1 <= summaries(result.output)[0][0] <= 3  # a sampled reply may end at a stop token before its limit
    plain = chat(pair, "hi\n", "--no-draft", "--max-tokens", "4")
    assert "plain decoding" in plain.output and "block size 1" in " ".join(plain.output.split())
    for bad in (["--temp", "-1"], ["--top-p", "1.5"], ["--max-tokens", "0"], ["--q-bits", "9"]):
        assert chat(pair, "", *bad).exit_code == 2
    too_big = chat(pair, "", "--block-size", "99")
    assert isinstance(too_big.exception, DFlashError) and "exceeds the drafter's" in str(too_big.exception)


def test_block_size_auto_by_default_a_number_fixes_it(pair, tmp_path):
    save = tmp_path / "a.json"
    result = chat(pair, f"hi\nmore\n/stats\n/save {save}\n", "--max-tokens", "10")
    assert result.exit_code == 0, result.output
    assert json.loads(save.read_text())["settings"]["block_size"] == "auto"
    out = " ".join(result.output.split())
    assert "block size auto" in out and "cost model: predicted" in out and len(summaries(result.output)) == 2
    fixed = chat(pair, f"hi\nmore\n/stats\n/save {save}\n", "--block-size", "8", "--max-tokens", "10")
    assert fixed.exit_code == 0, fixed.output
    assert json.loads(save.read_text())["settings"]["block_size"] == 8
    assert "cost model" not in fixed.output and len(summaries(fixed.output)) == 2


def test_every_slash_command(pair, tmp_path):
    save = tmp_path / "s.json"
    script = "\n".join([
        "/help", "/temp 0.5", "/temp abc", "/top-p 2", "/top-p 0.8", "/max-tokens 0", "/max-tokens 5",
        "/block-size 99", "/block-size auto", "/block-size 3", "/think maybe", "/think off", "/color off",
        "/system be brief",
        "/bogus", "/save", "first", "/stats", f"/save {save}", "/reset", "/stats", "/exit", "never sent",
    ]) + "\n"
    result = chat(pair, script)
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    for line in ["/think on|off", "temperature 0.5", "/temp needs a number, got 'abc'", "/top-p must be between",
                 "top-p 0.8", "/max-tokens must be >= 1", "max tokens 5", "exceeds the drafter's",
                 "block size 3", "/think takes on or off", "thinking off", "block size auto", "colours off",
                 "system message set",
                 "unknown command /bogus", "nothing to save: no caches yet", "saved 3 messages", "conversation reset",
                 "0 turns, 0 prompt tokens computed"]:
        assert line in out, line
    assert "never sent" not in out and len(summaries(out)) == 1
    data = json.loads(save.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    assert data["settings"]["think"] is False and data["settings"]["block_size"] == 3
    assert 1 <= len(data["acceptance_lengths"]) and max(data["acceptance_lengths"]) <= 3
    assert re.search(r"1 turns, \d+ prompt tokens computed, 5 generated", out)
    assert re.search(r"tokens/cycle cycles 1 \d+ #", out)  # the histogram table


def test_multiline_input_and_end_of_input(pair, tmp_path):
    save = tmp_path / "m.json"
    script = f'line one \\\nline two\n"""\nblock a\nblock b\n"""\n/save {save}\n'  # then Ctrl-D (end of input)
    result = chat(pair, script, "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    users = [m["content"] for m in json.loads(save.read_text())["messages"] if m["role"] == "user"]
    assert users == ["line one \nline two", "block a\nblock b"]


def test_embedded_default_target(pair, monkeypatch):
    target, _ = pair
    import mlx_dflash.loading.resolve

    monkeypatch.setattr(mlx_dflash.loading.resolve, "embedded_default_target", lambda: Path(target))
    monkeypatch.setattr(mlx_dflash.loading.resolve, "embedded_default_drafter", lambda: None)
    result = CliRunner().invoke(app, ["chat", "--max-tokens", "3"], input="hi\n")
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "embedded default" in out and "no trained DFlash drafter exists yet" in out
    assert "drafter none" in out and "prompt lookup alone" in out and "lookup on" in out
    assert summaries(out)[0][0] == 3


def test_embedded_default_drafter_is_used_when_shipped(pair, monkeypatch):
    import mlx_dflash.loading.resolve

    target, drafter = pair
    monkeypatch.setattr(mlx_dflash.loading.resolve, "embedded_default_target", lambda: Path(target))
    monkeypatch.setattr(mlx_dflash.loading.resolve, "embedded_default_drafter", lambda: Path(drafter))
    result = CliRunner().invoke(app, ["chat", "--max-tokens", "3"], input="hi\n")
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert f"drafter {drafter}" in out and "no trained DFlash drafter" not in out and "MODEL_CARD.md" in out


def test_quantized_target_goes_through_the_converted_cache(pair, tmp_path, monkeypatch):
    from helpers.tiny import greedy_reference

    import mlx_dflash
    from mlx_dflash import convert as convert_package

    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path))
    conversions = []
    real_convert = convert_package.convert

    def counted(*args, **kwargs):
        conversions.append(args[1])
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(convert_package, "convert", counted)
    replies = []
    for _ in range(2):  # converted on first use, reused after
        result = chat(pair, "hi\n", "--q-bits", "8", "--max-tokens", "6")
        assert result.exit_code == 0, result.output
        out = " ".join(result.output.split())
        assert "8-bit quantized (converted cache)" in out and 1 <= summaries(out)[0][0] <= 6
        replies.append(re.search(r"^>>> (.*?)\n\d+ tokens · ", result.output, re.MULTILINE | re.DOTALL).group(1))
    entries = list((tmp_path / "converted").iterdir())
    assert len(entries) == 1 and str(entries[0]) in "".join(result.output.split())  # the target line shows it
    assert conversions == [entries[0]]  # the second run found the entry and did not convert again
    # The reply is the converted (8-bit) model's own greedy reply.
    model, tokenizer, _ = mlx_dflash.load(str(entries[0]))
    assert hasattr(model.model.layers[0].self_attn.q_proj, "scales")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    expected = greedy_reference(model, list(ids), 6)
    expected = expected[: expected.index(EOS_ID)] if EOS_ID in expected else expected
    assert expected and replies == [tokenizer.decode(expected)] * 2


def test_bad_model_is_one_line_without_traceback(tmp_path):
    proc = subprocess.run([*CLI, "chat", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:") and "no such directory" in proc.stderr


class Terminal:
    """The chat in a pseudo-terminal (stdlib pty): keys in, screen text out."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a 100x30 terminal, then the chat
            import fcntl
            import termios
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
            os.execve(sys.executable, [*CLI, *argv], env)
        self.raw = ""

    def read_until(self, pattern: str, timeout: float = 60.0) -> str:
        """Read until `pattern` (a regex) appears in the ANSI-stripped output after the current mark."""
        deadline = time.monotonic() + timeout
        start = len(self.text)
        while not re.search(pattern, self.text[start:]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} in:\n{self.text[start:][-2000:]}")
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    self.raw += os.read(self.fd, 65536).decode("utf-8", "replace")
                except OSError:  # the child exited
                    raise AssertionError(f"exited before {pattern!r}:\n{self.text[start:][-2000:]}") from None
        return self.text[start:]

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 30.0, *, kill: bool = True) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.raw += os.read(self.fd, 65536).decode("utf-8", "replace")
            except OSError:
                time.sleep(0.1)
        if not kill:
            return None
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the chat did not exit:\n{self.text[-1000:]!r}")


def test_real_terminal_session(endless, tmp_path):
    target, drafter = endless
    env = dict(os.environ, TERM="xterm-256color", HOME=str(tmp_path), COLUMNS="100", LINES="30")
    env.pop("NO_COLOR", None)
    term = Terminal(["chat", "--model", target, "--draft", drafter, "--max-tokens", "40"], env)
    try:
        term.read_until(r">>> ")
        term.send("hello there\r")
        out = term.read_until(r">>> ")
        assert summaries(out)[0][:2] == (40, len("<u>hello there</s><a>") - 3)
        assert "\x1b[1m" in term.raw  # the target's own tokens are styled when the terminal allows it
        # A long reply, stopped by Ctrl-C once it is streaming.
        term.send("/max-tokens 100000\r")
        term.read_until(r"max tokens 100000\s+>>> ")
        term.send("tell me a long story\r")
        term.read_until(r"tok/s · tau")  # the live status line: the reply is streaming
        term.send("\x03")
        out = term.read_until(r"interrupted\s+>>> ")
        generated = summaries(out)[0][0]
        assert 0 < generated < 100000
        save = tmp_path / "after.json"
        term.send(f"/save {save}\r")
        term.read_until(r"saved 4 messages")
        messages = json.loads(save.read_text())["messages"]
        assert messages[2] == {"role": "user", "content": "tell me a long story"}
        assert len(messages[3]["content"]) > 0 and messages[3]["role"] == "assistant"
        # The conversation goes on from the kept history, reusing its cache.
        term.send("/max-tokens 5\r")
        term.read_until(r"max tokens 5\s+>>> ")
        term.send("go on\r")
        out = term.read_until(r">>> ")
        n, new, cached = summaries(out)[0]
        assert n == 5 and cached > generated and new < 20
        term.send("/reset\r")
        term.read_until(r"conversation reset\s+>>> ")
        term.send("/exit\r")
        assert term.wait() == 0
    finally:
        try:
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(term.fd)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux turns an end-of-file mark into a NUL in raw mode")
def test_a_ctrl_d_pressed_before_the_prompt_is_found_and_nothing_else_is_taken():
    """A Ctrl-D pressed while no prompt is up waits as an end-of-file mark (readline, in raw mode,
    would read a NUL): it is found and read; typed-ahead text is left; while a line is read, the
    key arrives as itself."""
    import termios

    from mlx_dflash.cli.terminal_input import _ctrl_d_kept_as_a_key

    master, slave = pty.openpty()
    try:
        with _ctrl_d_kept_as_a_key(slave) as ended:
            assert not ended  # nothing typed
        os.write(master, b"\x04")
        assert select.select([slave], [], [], 10)[0]  # taken in (the terminal does it asynchronously)
        with _ctrl_d_kept_as_a_key(slave) as ended:
            assert ended and not select.select([slave], [], [], 0)[0]  # the mark was read
            os.write(master, b"\x04\n")  # pressed now: the key itself, for readline
            assert os.read(slave, 100) == b"\x04\n"
        os.write(master, b"abc")  # an unfinished line: readline's to read
        with _ctrl_d_kept_as_a_key(slave) as ended:
            assert not ended
        os.write(master, b"\n")
        assert select.select([slave], [], [], 10)[0]
        with _ctrl_d_kept_as_a_key(slave) as ended:
            assert not ended  # a line of text: left for readline
        assert os.read(slave, 100) == b"abc\n"
        assert termios.tcgetattr(slave)[6][termios.VEOF] == b"\x04"  # the terminal as it was
    finally:
        os.close(master)
        os.close(slave)


def test_ctrl_d_and_ctrl_c_end_the_chat_whenever_pressed(pair, tmp_path):
    """No key is lost: not a Ctrl-D typed ahead (the terminal keeps it as an end-of-file mark,
    which readline would read as a NUL), not a Ctrl-C sent the moment a prompt is drawn (before
    readline waits on the terminal, where the signal alone does not wake it)."""
    target, drafter = pair
    env = dict(os.environ, TERM="xterm-256color", HOME=str(tmp_path))
    argv = ["chat", "--model", target, "--draft", drafter, "--max-tokens", "200"]

    def session(keys) -> None:
        term = Terminal(argv, env)
        try:
            keys(term)
            assert term.wait() == 0 and ">>> " in term.text
        finally:
            os.close(term.fd)

    def ctrl_d_before_the_chat_started(term: Terminal) -> None:
        term.send("\x04")

    def ctrl_c_as_the_first_prompt_is_drawn(term: Terminal) -> None:  # was lost one time in two to five
        term.read_until(r">>> ")
        term.send("\x03")

    def ctrl_c_in_blocks_then_ctrl_d_while_a_reply_streams(term: Terminal) -> None:
        term.read_until(r">>> ")
        for _ in range(16):  # each is lost now and then, as at the first prompt
            term.send('"""\r')
            term.read_until(r"\.\.\. ")
            term.send("\x03")  # in a block: cancels the message, back at the prompt
            term.read_until(r">>> ", timeout=15.0)
        term.send('"""\r')
        term.read_until(r"\.\.\. ")
        term.send("\x04")  # ends the (empty) block
        term.read_until(r">>> ", timeout=15.0)
        term.send("hello there\r")
        term.read_until(r"tok/s")  # the reply streams, the terminal is in line mode again
        term.send("\x04")  # leaves once the reply is done

    for keys in (ctrl_d_before_the_chat_started, ctrl_c_as_the_first_prompt_is_drawn,
                 ctrl_c_in_blocks_then_ctrl_d_while_a_reply_streams):
        session(keys)
