"""The server's Prometheus metrics (vLLM's names under the `kvfold:` prefix), one registry per app.

Latencies are observed by the engine thread as it hands tokens to requests
(serving.async_llm.Observer); the engine's state is read from the snapshot it takes
after each step, so a scrape never waits on a step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.params import RequestOutput

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """TTFT / inter-token / end-to-end latency histograms, token and request counters, and
    gauges read from `stats()` (an serving.async_llm.EngineStats) at scrape time."""

    def __init__(self, stats):
        self.registry = CollectorRegistry()
        self._stats = stats
        r = self.registry
        self.ttft = Histogram("kvfold:time_to_first_token_seconds", "Time from request arrival to its "
                              "first token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("kvfold:inter_token_latency_seconds", "Time between consecutive tokens of a "
                             "request (0 for tokens that arrive together)", buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvfold:e2e_request_latency_seconds", "Time from request arrival to its "
                             "last token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("kvfold:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvfold:generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("kvfold:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("kvfold:request_rejected", "Requests refused before the engine: "
                                "429 overloaded, 400 invalid, 401 unauthorized, 413 too large", ["code"],
                                registry=r)
        self.prefix_queries = Counter("kvfold:prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache", registry=r)
        self.prefix_hits = Counter("kvfold:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   registry=r)
        self.prefix_totals = [0, 0]  # queries, hits: the hit rate's parts (counters cannot be read back)
        r.register(_EngineCollector(self))

    # -- serving.async_llm.Observer ----------------------------------------------------

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def tokens(self, gap_s: float, num_tokens: int) -> None:
        self.itl.observe(gap_s)
        for _ in range(num_tokens - 1):
            self.itl.observe(0.0)

    def finished(self, output: RequestOutput, num_generated: int, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        num_prompt = len(output.prompt_token_ids)
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self.prefix_queries.inc(num_prompt)
        self.prefix_hits.inc(output.num_cached_tokens)
        self.prefix_totals[0] += num_prompt
        self.prefix_totals[1] += output.num_cached_tokens
        for o in output.outputs:
            self.requests.labels(finished_reason=o.finish_reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges of the engine's last snapshot, and the hit rate of the counters so far."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics._stats()
        yield GaugeMetricFamily("kvfold:num_requests_running", "Requests in the running batch",
                                value=s.num_running)
        yield GaugeMetricFamily("kvfold:num_requests_waiting", "Requests waiting to be scheduled",
                                value=s.num_waiting)
        yield GaugeMetricFamily("kvfold:kv_cache_usage_perc", "Fraction of KV pages in use (held by a "
                                "sequence; idle prefix-cache pages count as free)",
                                value=s.kv_used_pages / s.kv_total_pages)
        yield CounterMetricFamily("kvfold:num_preemptions", "Sequences preempted (recomputed or swapped)",
                                  value=s.num_preemptions)
        by_tier = CounterMetricFamily("kvfold:prefix_cache_hits_by_tier", "Prompt tokens served from "
                                      "each tier of the prefix cache (device, host, disk or store)", labels=["tier"])
        for tier, tokens in s.cache_hits_by_tier:
            by_tier.add_metric([tier], tokens)
        yield by_tier
        queries, hits = self.metrics.prefix_totals
        yield GaugeMetricFamily("kvfold:prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                                "cache over prompt tokens, since start", value=hits / queries if queries else 0.0)
