"""`flintc serve`: an OpenAI-compatible HTTP server over a `ModelRunner`.

* :mod:`flintc.serve.engine`: the continuous-batching scheduler on its own thread;
* :mod:`flintc.serve.app`: the FastAPI routes (``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions``, ``/health``, and vLLM's ``/tokenize``, ``/detokenize``,
  ``/version``, ``/metrics``);
* :mod:`flintc.serve.metrics`: vLLM's Prometheus metrics, fed by the engine;
* :mod:`flintc.serve.protocol`: request models and the OpenAI error format;
* :mod:`flintc.serve.reasoning` / :mod:`flintc.serve.tool_calls`: the GLM-4.7
  ``<think>`` and ``<tool_call>`` parsers;
* :mod:`flintc.serve.server`: loading a model for the CLI (:func:`make_runner`) and
  running uvicorn.

See docs/serve.md.
"""
