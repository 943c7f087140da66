"""DFlash across machines: the target tensor-parallel over `mx.distributed`, rank 0 drafting.

Started by `mlx.launch` (ring, JACCL or MPI), every rank runs the same decode loop on
its shard of the target (mlx-lm's `Model.shard`), after checking at start-up that every
rank runs the same packages and model files (`rank_agreement`). A backend's
floating-point all-reduce need not be bit-identical on every rank, and one differing
token would silently desynchronise the shards' caches. So rank 0 decides: the prompt's
ids, the verify inputs and the target's chosen tokens are broadcast from rank 0 (one
small all-reduce each per cycle) and every rank commits exactly rank 0's tokens, sampled
ones included. The other ranks' drafts would be replaced anyway, so they do not draft
(`rank_follower`), except where the draft logits are themselves a collective.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..errors import DFlashError

TIMEOUT_ENV = "MLX_DFLASH_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 300.0  # seconds without progress before a rank gives up on the others


@dataclass
class Distributed:
    """This process's place in the group, and the few collective operations the engine needs."""

    group: mx.distributed.Group
    comm_seconds: float = 0.0  # time spent in the explicit broadcasts (measured where they sync)
    _last_progress: float = field(default_factory=time.monotonic)
    _watchdog: threading.Thread | None = None
    _paused: bool = False

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, x: mx.array, root: int = 0) -> mx.array:
        """Rank `root`'s value of `x` on every rank (lazy: an all-reduce of x masked to that rank)."""
        # Masked by multiplication, not replaced by zeros: the all-reduce must depend on x on every
        # rank, so that every rank issues its collectives in the same order when the graph runs.
        mine = x * mx.array(1 if self.rank == root else 0, dtype=x.dtype)
        return mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu).astype(x.dtype)

    def barrier(self) -> None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group, stream=mx.cpu))

    def share_tokens(self, tokens: list[int] | None, root: int = 0) -> list[int]:
        """Rank `root`'s token list on every rank (the others pass anything, e.g. None)."""
        start = time.perf_counter()
        sender = self.rank == root
        n = self.agree(mx.array([len(tokens) if sender and tokens is not None else 0], dtype=mx.int32), root)
        count = int(n.item())
        data = mx.array(tokens if sender and count else [0] * count, dtype=mx.int32)
        out = self.agree(data, root).tolist() if count else []
        self.comm_seconds += time.perf_counter() - start
        return out

    def share_text(self, text: str | None, root: int = 0) -> str | None:
        """Rank `root`'s string (or None) on every rank: what rank 0 read from stdin, for example."""
        encoded = None if text is None else [1, *text.encode("utf-8")]
        shared = self.share_tokens(encoded, root)
        return bytes(shared[1:]).decode("utf-8") if shared else None

    def gather_rows(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (of one length on every rank) on every rank, in rank order (one all-reduce)."""
        table = mx.zeros((self.size, len(row)), dtype=mx.int32)
        table[self.rank] = mx.array(row, dtype=mx.int32)
        return mx.distributed.all_sum(table, group=self.group, stream=mx.cpu).tolist()

    def allreduce_seconds(self, rows: int, width: int, repeats: int = 8) -> float:
        """Measured time of one all-reduce of a (rows, width) float32 array (collective: every rank calls it)."""
        x = mx.zeros((rows, width), dtype=mx.float32)
        mx.eval(mx.distributed.all_sum(x, group=self.group, stream=mx.cpu))  # connections warm
        start = time.perf_counter()
        for _ in range(repeats):
            x = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
            mx.eval(x)
        return (time.perf_counter() - start) / repeats

    def cycle_comm_ms(self, num_layers: int, rows: int, width: int) -> float:
        """Estimated communication per verify cycle of `rows` tokens: mlx-lm's tensor parallelism
        all-reduces twice per decoder layer (attention and MLP outputs), plus the two decision
        broadcasts; each priced at a measured all-reduce of that size."""
        layers = 2 * num_layers * self.allreduce_seconds(rows, width)
        return 1000 * (layers + 2 * self.allreduce_seconds(1, rows))

    # -- liveness -------------------------------------------------------------------------
    def progress(self) -> None:
        """Called once per cycle: the watchdog measures silence from here."""
        self._last_progress = time.monotonic()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """No timeout while the group waits on purpose (a chat waiting for its user's next line)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self.progress()

    def give_up(self, reason: str) -> None:
        """End this process at once with one error line (the first reason wins; later ones are silent)."""
        if _GIVE_UP.acquire(blocking=False):  # never released: a second reason exits silently
            sys.stderr.write(f"error: rank {self.rank}: {reason}; stopping every rank\n")
            sys.stderr.flush()
        os._exit(1)

    def watch(self, timeout: float | None = None) -> None:
        """End this rank with one error line when the others stop answering (a rank died, a link dropped),
        instead of blocking in an all-reduce forever; also on SIGTERM (mlx.launch ends the survivors so)."""
        if self._watchdog is not None:
            return
        limit = timeout if timeout is not None else float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))

        def loop() -> None:
            while True:
                time.sleep(min(1.0, limit / 4))
                silent = time.monotonic() - self._last_progress
                if silent > limit and not self._paused:
                    self.give_up(f"no progress for {silent:.0f} s (another rank died or the connection dropped; "
                                 f"{TIMEOUT_ENV} sets the limit)")

        signal.signal(signal.SIGTERM, lambda *_: self.give_up("another rank ended (terminated by the launcher)"))
        self.progress()
        self._watchdog = threading.Thread(target=loop, name="dflash-watchdog", daemon=True)
        self._watchdog.start()


_WORLD: list[Distributed | None] = []
_GIVE_UP = threading.Lock()  # taken for good by the first reason to end the process


def world() -> Distributed | None:
    """The group this process was launched into by `mlx.launch`, or None when it runs alone."""
    if not _WORLD:
        group = mx.distributed.init() if mx.distributed.is_available() else None
        _WORLD.append(Distributed(group) if group is not None and group.size() > 1 else None)
    return _WORLD[0]


def is_main_process() -> bool:
    """True on rank 0, or when not distributed: the one process that prints and writes files."""
    w = world()
    return w is None or w.is_main


def world_size() -> int:
    w = world()
    return 1 if w is None else w.size


def shard_target(model: nn.Module, w: Distributed) -> None:
    """mlx-lm's tensor parallelism for this family (attention heads and MLP columns split across ranks),
    then the shard is materialised and every rank waits for the others."""
    if not hasattr(model, "shard"):
        kind = getattr(model, "model_type", type(model).__name__)
        raise DFlashError(f"mlx-lm has no tensor-parallel sharding for {kind} targets; run it on one machine")
    args = getattr(model, "args", None)
    args = getattr(args, "text_config", None) or args  # multimodal checkpoints nest the text model's
    heads = [getattr(args, name, None) for name in ("num_attention_heads", "num_key_value_heads")]
    if isinstance(args, dict):
        heads = [args.get(name) for name in ("num_attention_heads", "num_key_value_heads")]
    if any(isinstance(n, int) and n % w.size for n in heads):
        # mlx-lm would split the heads' rows anyway and fail (or compute garbage) at the first forward.
        raise DFlashError(f"cannot shard this target over {w.size} ranks: its {heads[0]} attention heads and "
                          f"{heads[1]} key/value heads must both divide by {w.size}")
    try:
        model.shard(w.group)
    except (ValueError, AssertionError) as e:
        raise DFlashError(f"cannot shard this target over {w.size} ranks ({e})") from None
    mx.eval(model.parameters())
    w.barrier()
    w.watch()


def one_rank_at_a_time(fn, *args, **kwargs):
    """Run `fn` on each rank in turn (rank 0 first): conversions into a cache that ranks on one
    machine share are then done once and found by the others, never raced."""
    w = world()
    if w is None:
        return fn(*args, **kwargs)
    result = None
    for turn in range(w.size):
        if turn == w.rank:
            result = fn(*args, **kwargs)
        w.barrier()
    return result
