"""The chat's line input: `input()`, except that no Ctrl-D or Ctrl-C the user presses is lost.

Two keys go missing with a plain `input()` over GNU readline:

- On Linux, Ctrl-D pressed while no prompt is up (the model loads, a reply streams) waits in
  the terminal's line buffer as an end-of-file mark. Readline then puts the terminal in raw
  mode, which turns the mark into a NUL byte, read as "set mark": the Ctrl-D is gone. So the
  terminal's end-of-file key is switched off while a line is read (from then on a Ctrl-D
  reaches readline as the key itself, which ends input), and a mark made before is looked for
  and read first.
- Ctrl-C landing after readline drew the prompt but before it waits on the terminal only
  sets Python's signal flag; readline's wait is interrupted by the next key, not by that
  signal. A watcher thread learns of the signal (`signal.set_wakeup_fd`) and, until the read
  ends, wakes the main thread with a no-op signal, so the pending KeyboardInterrupt is raised.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

NUDGE = getattr(signal, "SIGUSR1", None)  # the no-op signal that interrupts readline's wait (POSIX)
NUDGE_EVERY = 0.05  # seconds between wake-ups while a Ctrl-C waits to be acted on


def read_line(prompt: str) -> str:
    """`input(prompt)`: EOFError on Ctrl-D and KeyboardInterrupt on Ctrl-C, whenever pressed."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    with _ctrl_d_kept_as_a_key(fd) as ended:
        if ended:
            print(prompt, end="", flush=True)
            raise EOFError
        with _ctrl_c_interrupts_the_wait():
            return input(prompt)


@contextmanager
def _ctrl_d_kept_as_a_key(fd: int | None) -> Iterator[bool]:
    """Terminal `fd`'s end-of-file key off for the body; yields whether a Ctrl-D pressed on an
    empty line before waits as an end-of-file mark (then read)."""
    try:
        import termios
    except ImportError:  # not a POSIX terminal
        yield False
        return
    try:
        saved = termios.tcgetattr(fd) if fd is not None and sys.platform == "linux" else None
    except termios.error:
        saved = None
    if saved is None or not saved[3] & termios.ICANON:  # no line buffer, so no end-of-file marks
        yield False
        return
    keyless = [*saved[:6], list(saved[6])]
    keyless[6][termios.VEOF] = bytes([os.fpathconf(fd, "PC_VDISABLE")])
    termios.tcsetattr(fd, termios.TCSANOW, keyless)
    try:
        yield _end_of_file_mark_waiting(fd)
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _end_of_file_mark_waiting(fd: int) -> bool:
    """Whether the terminal's line buffer starts with an end-of-file mark (read when it does)."""
    import fcntl
    import termios

    try:
        if not select.select([fd], [], [], 0)[0]:
            return False
        # In line mode the terminal counts the bytes of complete lines, end-of-file marks left out:
        # readable with none waiting means an end-of-file mark comes first.
        waiting = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return False
    return waiting == 0 and os.read(fd, 1) == b""


@contextmanager
def _ctrl_c_interrupts_the_wait() -> Iterator[None]:
    """For the body (a read by readline): a Ctrl-C raises KeyboardInterrupt without a further key."""
    if NUDGE is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)  # the signal handler must never block on it
    done = threading.Event()
    main = threading.main_thread().ident

    def watch() -> None:
        while not done.is_set():
            if signal.SIGINT in os.read(wake_r, 256):  # the numbers of the signals handled since
                while not done.is_set():
                    signal.pthread_kill(main, NUDGE)
                    done.wait(NUDGE_EVERY)

    watcher = threading.Thread(target=watch, name="ctrl-c-watcher", daemon=True)
    previous_fd = previous_nudge = None
    try:
        previous_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        previous_nudge = signal.signal(NUDGE, _ignore)
        watcher.start()
        yield
    finally:
        done.set()
        if previous_fd is not None:
            signal.set_wakeup_fd(previous_fd)
        try:
            os.write(wake_w, b"\0")  # ends the watcher's read
        except BlockingIOError:  # a full pipe: the watcher has bytes to read anyway
            pass
        if watcher.ident is not None:
            watcher.join()
        # Only now: a nudge sent before the watcher ended has met the no-op handler.
        if previous_nudge is not None:
            signal.signal(NUDGE, previous_nudge)
        os.close(wake_r)
        os.close(wake_w)


def _ignore(signum: int, frame: object) -> None:
    pass
