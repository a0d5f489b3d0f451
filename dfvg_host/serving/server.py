"""Putting a server together, and running it in the foreground or on a thread.

:func:`open_served_model` loads the target into a batched verifier, opens the draft
device with the compiled draft, and starts the scheduler; :class:`BackgroundServer` runs
the application under uvicorn on a thread of this process (tests and benchmarks drive
it over real HTTP on 127.0.0.1); :func:`serve_forever` is ``dfvg serve``.

With a tensor-parallel target (``tp_plan`` under ``torchrun`` with more than one rank)
these run on rank 0 only: the verifier is wrapped in a
:class:`~dfvg_host.serving.distributed.BroadcastVerifier`, the other ranks
:func:`~dfvg_host.serving.distributed.follow` it, and stopping the server (``stop()``, the
end of :func:`serve_forever`, SIGINT or SIGTERM) tells them to stop too.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import uvicorn

from dfvg_host.serving import distributed
from dfvg_host.serving.app import ServedModel, create_app
from dfvg_host.serving.scheduler import Scheduler

__all__ = ["open_served_model", "BackgroundServer", "serve_forever"]


def open_served_model(target_dir: Path, device, *, tokenizer, name: str | None = None,
                      gamma: int = 4, max_num_seqs: int = 16, max_waiting: int | None = None,
                      chat_template: str | None = None, verifier_device: str | None = None,
                      dtype: str | None = None, device_map: str | None = None,
                      tp_plan: str | None = None) -> ServedModel:
    """A started scheduler over the target in ``target_dir`` and the draft ``device`` (a
    :class:`~dfvg_host.driver.DraftDevice`; None: target-only serving).

    With ``tp_plan`` over several ranks, call it on rank 0 while the others load the target
    with the same plan and :func:`~dfvg_host.serving.distributed.follow`."""
    from dfvg_host.batch_verifier import BatchVerifier

    verifier = BatchVerifier.from_pretrained(target_dir, device=verifier_device, dtype=dtype,
                                             device_map=device_map, tp_plan=tp_plan)
    if tp_plan is not None and distributed.world_size() > 1:
        verifier = distributed.BroadcastVerifier(verifier)
    try:
        scheduler = Scheduler(verifier, device, gamma=gamma, max_num_seqs=max_num_seqs,
                              max_waiting=max_waiting, eos_token_id=tokenizer.eos_token_id).start()
    except BaseException:
        distributed.shutdown()             # the followers would wait for calls that never come
        raise
    return ServedModel(name or Path(target_dir).name, scheduler, tokenizer, chat_template)


def _close(served: ServedModel) -> None:
    """Stop the scheduler (its last calls end the sequences it ran), then the followers of a
    tensor-parallel verifier."""
    served.scheduler.stop()
    if isinstance(served.scheduler.verifier, distributed.BroadcastVerifier):
        distributed.shutdown()


class BackgroundServer:
    """The application of ``served`` under uvicorn on a thread of this process.

    Members
    -------
    served : ServedModel
    url : str
        ``http://host:port`` once started (``port=0`` picks a free port).
    """

    def __init__(self, served: ServedModel, host: str = "127.0.0.1", port: int = 0):
        self.served = served
        config = uvicorn.Config(create_app(served), host=host, port=port, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="dfvg-http", daemon=True)
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (is the port free?)")
            time.sleep(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        _close(self.served)

    def __enter__(self) -> "BackgroundServer":
        return self if self.url else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(served: ServedModel, host: str, port: int, log_level: str = "info") -> None:
    """``dfvg serve``: the application under uvicorn until interrupted.

    Tensor-parallel (rank 0): SIGTERM ends it as SIGINT does (uvicorn shuts down gracefully,
    then re-raises the signal, here a ``SystemExit``), so that the followers are told to
    stop; once stopping, further signals are ignored until they have been."""
    broadcasting = isinstance(served.scheduler.verifier, distributed.BroadcastVerifier) and \
        threading.current_thread() is threading.main_thread()
    if broadcasting:
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        uvicorn.run(create_app(served), host=host, port=port, log_level=log_level)
    finally:
        if broadcasting:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        _close(served)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)
