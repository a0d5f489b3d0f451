"""Putting a server together, and running it in the foreground or on a thread.

:func:`open_served_model` loads the target into a batched verifier, opens the draft
device with the compiled draft, and starts the scheduler; :class:`BackgroundServer` runs
the application under uvicorn on a thread of this process (tests and benchmarks drive
it over real HTTP on 127.0.0.1); :func:`serve_forever` is ``dfvg serve``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import uvicorn

from dfvg_host.serving.app import ServedModel, create_app
from dfvg_host.serving.scheduler import Scheduler

__all__ = ["open_served_model", "BackgroundServer", "serve_forever"]


def open_served_model(target_dir: Path, device, *, tokenizer, name: str | None = None,
                      gamma: int = 4, max_num_seqs: int = 16, max_waiting: int | None = None,
                      chat_template: str | None = None, verifier_device: str | None = None,
                      dtype: str | None = None, device_map: str | None = None,
                      tp_plan: str | None = None) -> ServedModel:
    """A started scheduler over the target in ``target_dir`` and the draft ``device`` (a
    :class:`~dfvg_host.driver.DraftDevice`; None: target-only serving)."""
    from dfvg_host.batch_verifier import BatchVerifier

    verifier = BatchVerifier.from_pretrained(target_dir, device=verifier_device, dtype=dtype,
                                             device_map=device_map, tp_plan=tp_plan)
    scheduler = Scheduler(verifier, device, gamma=gamma, max_num_seqs=max_num_seqs,
                          max_waiting=max_waiting, eos_token_id=tokenizer.eos_token_id).start()
    return ServedModel(name or Path(target_dir).name, scheduler, tokenizer, chat_template)


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
        self.served.scheduler.stop()

    def __enter__(self) -> "BackgroundServer":
        return self if self.url else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(served: ServedModel, host: str, port: int, log_level: str = "info") -> None:
    """``dfvg serve``: the application under uvicorn until interrupted."""
    try:
        uvicorn.run(create_app(served), host=host, port=port, log_level=log_level)
    finally:
        served.scheduler.stop()
