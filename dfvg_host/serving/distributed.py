"""Serving a tensor-parallel target: rank 0 serves, every other rank repeats its verifier calls.

Under tensor parallelism (``torchrun --nproc-per-node N -m dfvg_host.cli serve
--tensor-parallel``) every rank holds a shard of the target, and a forward pass is a
collective: all ranks must run the same forwards, in the same order. Rank 0 runs the
whole server (HTTP, scheduler, draft device) with its verifier wrapped in a
:class:`BroadcastVerifier`, which sends each ``add`` / ``score`` / ``commit`` / ``remove``
with its arguments to the other ranks before running it itself. The other ranks load the
target with the same plan and :func:`follow`: receive a call, run it on their own
:class:`~dfvg_host.batch_verifier.BatchVerifier`, until :func:`shutdown`.

The calls travel over a ``gloo`` group of their own (``broadcast_object_list``), whatever
backend the target's shards use, with a timeout long enough for an idle server. A rank 0
that dies closes its connections: the followers' wait fails at once and :func:`follow`
raises :class:`LeaderLost`. Only one thread of rank 0 may issue the calls (the
scheduler's, whose calls are serialised anyway); one :class:`BroadcastVerifier` per
process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import threading

import torch.distributed as dist

__all__ = ["rank", "world_size", "under_torchrun", "BroadcastVerifier", "follow", "shutdown", "LeaderLost"]

#: The verifier calls that change state on every rank (and run a forward pass).
CALLS = ("add", "score", "commit", "remove")
#: How long a follower waits for the next call: an idle server sends nothing.
IDLE_TIMEOUT = datetime.timedelta(days=365)

_channel_group = None
_channel_lock = threading.Lock()
_shut_down = False


class LeaderLost(RuntimeError):
    """Rank 0 went away (crashed or killed) while a follower waited for its next call."""


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or joined a process group)."""
    return (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank: torch.distributed's once initialised, else torchrun's ``RANK``
    (0 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """The number of ranks: torch.distributed's once initialised, else torchrun's
    ``WORLD_SIZE`` (1 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def _channel():
    """The gloo group the calls travel over; created on first use, by every rank in turn
    (``new_group`` is collective: rank 0 in :class:`BroadcastVerifier`, the others in
    :func:`follow`, both after loading the target)."""
    global _channel_group
    if _channel_group is None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: load the target with tp_plan "
                               "under torchrun first")
        _channel_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return _channel_group


def _send(message: tuple) -> None:
    with _channel_lock:
        if _shut_down:
            raise RuntimeError("the other ranks were shut down; the tensor-parallel verifier is closed")
        dist.broadcast_object_list([message], src=0, group=_channel())


def _receive() -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_channel())
    return box[0]


class BroadcastVerifier:
    """Rank 0's verifier: each call that changes state is broadcast to the followers, then
    run here. The scheduler sees the :class:`~dfvg_host.batch_verifier.BatchVerifier` API.

    Creating it is collective: it joins the call channel that :func:`follow` joins on the
    other ranks.

    Members
    -------
    verifier : BatchVerifier
        Rank 0's own shard of the target.
    model, device, vocab_size, seconds, forwards
        Those of :attr:`verifier` (rank 0's forward time and count).
    """

    def __init__(self, verifier):
        self.verifier = verifier
        _channel()

    @property
    def model(self):
        return self.verifier.model

    @property
    def device(self):
        return self.verifier.device

    @property
    def vocab_size(self) -> int:
        return self.verifier.vocab_size

    @property
    def seconds(self) -> float:
        return self.verifier.seconds

    @property
    def forwards(self) -> int:
        return self.verifier.forwards

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.verifier

    def __len__(self) -> int:
        return len(self.verifier)

    def length(self, seq_id: int) -> int:
        return self.verifier.length(seq_id)

    def add(self, seq_id: int, prompt: list[int]) -> None:
        self._call("add", seq_id, list(prompt))

    def score(self, drafts_by_seq: dict[int, list[int]]):
        return self._call("score", {i: list(d) for i, d in drafts_by_seq.items()})

    def commit(self, seq_id: int, accepted: int, drafted: int, next_token: int) -> None:
        self._call("commit", seq_id, accepted, drafted, next_token)

    def remove(self, seq_id: int) -> None:
        self._call("remove", seq_id)

    def _call(self, name: str, *args):
        _send((name, args))
        return getattr(self.verifier, name)(*args)


@contextlib.contextmanager
def _signals_noted():
    """SIGINT and SIGTERM do not stop a follower: torchrun and a terminal send them to every
    rank, and the follower must stay to repeat rank 0's last calls (the sequences it ends)
    until rank 0 says :func:`shutdown`. (torchrun kills what is left after its grace period.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def follow(verifier) -> None:
    """A follower's loop (any rank but 0): run each call rank 0 broadcasts on ``verifier``,
    until rank 0's :func:`shutdown`. Raises :class:`LeaderLost` when rank 0 goes away.

    A call that fails here failed on rank 0 as well (the same checks of the same
    arguments), which reports it; the follower goes on."""
    me = rank()
    if me == 0:
        raise RuntimeError("rank 0 serves; follow() is for the other ranks")
    with _signals_noted():
        while True:
            try:
                name, args = _receive()
            except RuntimeError as exc:
                raise LeaderLost(f"rank {me}: lost rank 0 while following it ({_reason(exc)})") from None
            if name == "shutdown":
                with contextlib.suppress(RuntimeError):    # rank 0 waits until all have heard it
                    dist.barrier(group=_channel())
                return
            if name not in CALLS:
                raise RuntimeError(f"rank {me}: rank 0 sent an unknown call {name!r}")
            try:
                getattr(verifier, name)(*args)
            except Exception:                          # noqa: BLE001 - rank 0 raises it too
                pass


def _reason(exc: BaseException) -> str:
    """The first sentence of a gloo error, without its source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())
    return text.split(". ")[0].splitlines()[0][:200] if text else type(exc).__name__


def shutdown() -> bool:
    """Rank 0: tell the followers to return from :func:`follow`, and wait until all have
    heard it. Once; afterwards the :class:`BroadcastVerifier` refuses calls. False when
    nothing was sent (no channel, already done, or the followers are gone)."""
    global _shut_down
    with _channel_lock:
        if _shut_down or _channel_group is None or rank() != 0:
            return False
        _shut_down = True
        try:
            dist.broadcast_object_list([("shutdown", ())], src=0, group=_channel_group)
            dist.barrier(group=_channel_group)
        except RuntimeError:                           # a follower died first: nobody to tell
            return False
        return True
