"""Prometheus metrics of `flintc serve` (``GET /metrics``), under vLLM's names, so that
dashboards made for vLLM (its Grafana example included) work unchanged.

Every series has vLLM's labels ``model_name`` (the served model id) and ``engine``
("0": one engine); ``vllm:request_success_total`` adds ``finished_reason``. The
values come from what the engine does (:class:`~flintc.serve.engine.EngineObserver`
calls on the engine thread, and its queues read at scrape time), one engine request
per choice (a request with ``n`` = 3 counts three times, as in vLLM):

* gauges ``vllm:num_requests_running`` (sequences in a KV-cache slot) and
  ``vllm:num_requests_waiting`` (submitted, not yet admitted);
* counters ``vllm:prompt_tokens_total`` (tokens prefilled),
  ``vllm:generation_tokens_total`` (tokens sampled, stop tokens included, as the
  ``usage`` of a response counts them) and ``vllm:request_success_total`` by
  finished_reason "stop", "length" or "abort" (a request that failed is not counted);
* histograms ``vllm:time_to_first_token_seconds`` (queued to first token),
  ``vllm:inter_token_latency_seconds`` and its older name
  ``vllm:time_per_output_token_seconds`` (each gap between two tokens of a request),
  and for each request that finished with "stop" or "length":
  ``vllm:e2e_request_latency_seconds`` (queued to finished),
  ``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds``
  (admitted to first token), ``vllm:request_decode_time_seconds`` (first to last
  token), ``vllm:request_inference_time_seconds`` (admitted to last token),
  ``vllm:request_time_per_output_token_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens`` and ``vllm:request_params_max_tokens``.

Buckets are vLLM's. Each server has its own ``CollectorRegistry`` (not
prometheus_client's global one), so several servers in one process do not clash.
Times are from the engine's ``time.monotonic()`` stamps; the HTTP side (tokenizing
before the request is queued, sending the response) is not in them.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from flintc.serve.engine import Engine, EngineObserver, GenRequest

FINISHED_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServeMetrics(EngineObserver):
    """The metrics of one server over ``engine`` (added to ``engine.observers`` here).

    ``render(accept)`` -> (the exposition, its content type).
    """

    def __init__(self, engine: Engine, model_name: str):
        self.registry = CollectorRegistry()
        self.engine = engine
        names = ("model_name", "engine")
        values = (model_name, "0")
        count_buckets = build_1_2_5_buckets(engine.max_model_len)

        def make(cls, name, doc, **kw):
            return cls(name, doc, names, registry=self.registry, **kw).labels(*values)

        make(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.") \
            .set_function(lambda: engine.num_running)
        make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.") \
            .set_function(lambda: engine.num_waiting)
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.cache_queries = make(Counter, "vllm:prefix_cache_queries",
                                  "Prefix cache queries, in terms of number of queried tokens.")
        self.cache_hits = make(Counter, "vllm:prefix_cache_hits",
                               "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*names, "finished_reason"), registry=self.registry)
        self.success = {r: success.labels(*values, r) for r in FINISHED_REASONS}
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self.itl = [make(Histogram, "vllm:inter_token_latency_seconds",
                         "Histogram of inter-token latency in seconds.", buckets=TOKEN_LATENCY_BUCKETS),
                    make(Histogram, "vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds (the older name of "
                         "vllm:inter_token_latency_seconds).", buckets=TOKEN_LATENCY_BUCKETS)]
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", buckets=REQUEST_LATENCY_BUCKETS)
        self.queue = make(Histogram, "vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self.prefill = make(Histogram, "vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self.decode = make(Histogram, "vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self.inference = make(Histogram, "vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.",
                              buckets=REQUEST_LATENCY_BUCKETS)
        self.tpot = make(Histogram, "vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", buckets=TOKEN_LATENCY_BUCKETS)
        self.req_prompt = make(Histogram, "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                               buckets=count_buckets)
        self.req_generation = make(Histogram, "vllm:request_generation_tokens",
                                   "Number of generation tokens processed.", buckets=count_buckets)
        self.req_max_tokens = make(Histogram, "vllm:request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.", buckets=count_buckets)
        engine.observers.append(self)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The metrics in the format the ``Accept`` header asks for, as prometheus_client's
        own server picks it (OpenMetrics, or Prometheus text; by default text 0.0.4).
        -> (the bytes, their content type)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    # ---- EngineObserver (the engine thread) -------------------------------------------
    def prefilled(self, req: GenRequest) -> None:
        self.prompt_tokens.inc(req.timeline.prompt_tokens)
        if self.engine.enable_prefix_caching and req.prompt_logprobs is None:  # vLLM: those skip the cache
            self.cache_queries.inc(req.timeline.prompt_tokens)
            self.cache_hits.inc(req.timeline.cached_tokens)

    def token(self, req: GenRequest, since_last: float | None) -> None:
        self.generation_tokens.inc()
        if since_last is None:
            self.ttft.observe(req.timeline.first_token - req.timeline.queued)
        else:
            for h in self.itl:
                h.observe(since_last)

    def finished(self, req: GenRequest, reason: str | None, error: str | None) -> None:
        if reason not in FINISHED_REASONS:
            return
        self.success[reason].inc()
        tl = req.timeline
        if reason == "abort" or tl.scheduled is None:
            return
        now = time.monotonic()
        first = tl.first_token if tl.first_token is not None else now
        last = tl.last_token if tl.last_token is not None else now
        self.e2e.observe(now - tl.queued)
        self.queue.observe(tl.scheduled - tl.queued)
        self.prefill.observe(first - tl.scheduled)
        self.decode.observe(last - first)
        self.inference.observe(last - tl.scheduled)
        # (as vLLM: 0 for a request of one token, so that every finished request is observed)
        self.tpot.observe((last - first) / (tl.generated_tokens - 1) if tl.generated_tokens > 1 else 0.0)
        self.req_prompt.observe(tl.prompt_tokens)
        self.req_generation.observe(tl.generated_tokens)
        self.req_max_tokens.observe(req.params.max_tokens)
