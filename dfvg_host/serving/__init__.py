"""``dfvg serve``: an OpenAI-compatible HTTP server over DFVG speculative decoding.

* :mod:`~dfvg_host.serving.scheduler` — decodes many sequences at once: each keeps its
  KV in its own slots of the one draft engine, and every round's drafts of all of them
  are verified in one batched target forward.
* :mod:`~dfvg_host.serving.protocol` — OpenAI's request fields, checked, and its error
  shape.
* :mod:`~dfvg_host.serving.text` — incremental detokenisation with stop strings.
* :mod:`~dfvg_host.serving.prometheus` — ``/metrics`` with vLLM's metric names.
* :mod:`~dfvg_host.serving.app` — the FastAPI application.
"""
