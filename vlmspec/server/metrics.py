"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server.

Counters are cumulative, so a scraper derives rates and pooled ratios itself: tau over
all finished requests is ``(vlmspec_spec_accepted_tokens_total + vlmspec_spec_rounds_total)
/ vlmspec_spec_rounds_total`` (also exported as the gauge ``vlmspec_spec_tau``), and the
acceptance of draft position k is ``accepted_by_position{position="k"} /
verified_by_position{position="k"}``, the pooling of :meth:`vlmspec.types.SpecStats.merge`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vlmspec.types import GenerationResult, SpecStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets from a fast GPU's milliseconds to a CPU's seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """Request, token, speculation, queue and latency metrics of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "vlmspec_requests", "Requests the engine finished, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "vlmspec_rejected_requests", "Requests answered with an error status before running", ["status"], registry=r
        )
        self.prompt_tokens = Counter("vlmspec_prompt_tokens", "Prompt tokens prefilled (vision included)", registry=r)
        self.generation_tokens = Counter("vlmspec_generation_tokens", "Tokens generated", registry=r)
        self.rounds = Counter("vlmspec_spec_rounds", "Speculative rounds (target verification forwards)", registry=r)
        self.drafted = Counter("vlmspec_spec_drafted_tokens", "Draft tokens proposed", registry=r)
        self.verified = Counter("vlmspec_spec_verified_tokens", "Draft tokens sent to the target", registry=r)
        self.accepted = Counter("vlmspec_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.verified_by_position = Counter(
            "vlmspec_spec_verified_by_position", "Rounds that verified draft position k", ["position"], registry=r
        )
        self.accepted_by_position = Counter(
            "vlmspec_spec_accepted_by_position", "Rounds that accepted draft position k", ["position"], registry=r
        )
        self.rounds_by_source = Counter(
            "vlmspec_spec_rounds_by_source",
            "Rounds by where their drafts came from, for a proposer that chooses per round "
            "(the drafting policy: ngram, corpus, model; none = drafting skipped)",
            ["source"],
            registry=r,
        )
        self.tau = Gauge("vlmspec_spec_tau", "Tokens committed per round over all finished requests", registry=r)
        self.running = Gauge("vlmspec_num_requests_running", "Requests in the engine's batch", registry=r)
        self.waiting = Gauge("vlmspec_num_requests_waiting", "Requests queued for the batch", registry=r)
        self.kv_blocks_used = Gauge("vlmspec_kv_cache_blocks_used", "KV pool blocks held by requests", registry=r)
        self.kv_blocks_limit = Gauge(
            "vlmspec_kv_cache_blocks_limit", "KV pool blocks the memory budget allows (--kv-cache-memory)", registry=r
        )
        self.kv_bytes_used = Gauge("vlmspec_kv_cache_bytes_used", "Bytes of KV held by requests", registry=r)
        self.kv_usage = Gauge("vlmspec_kv_cache_usage_ratio", "KV blocks in use over the budget's blocks", registry=r)
        self.preemptions = Gauge(
            "vlmspec_preemptions", "Requests preempted so far (KV freed, recomputed when they resume)", registry=r
        )
        self.prefix_blocks = Gauge(
            "vlmspec_prefix_cache_blocks", "KV blocks the prefix cache keeps (held by requests or idle)", registry=r
        )
        self.prefix_queried = Gauge(
            "vlmspec_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Gauge(
            "vlmspec_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "vlmspec_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache over those looked up", registry=r
        )
        self.ttft = Histogram(
            "vlmspec_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "vlmspec_time_per_output_token_seconds",
            "Mean time per token after the first, per request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "vlmspec_e2e_request_latency_seconds", "Arrival to the last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self._rounds = self._accepted = 0  # pooled over every finished request, for the tau gauge

    def finished(self, result: GenerationResult, ttft_s: float | None, e2e_s: float) -> None:
        """Count one request the engine finished (whatever the reason)."""
        stats = result.stats
        self.requests.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        self.rounds.inc(stats.rounds)
        self.drafted.inc(stats.drafted)
        self.verified.inc(stats.verified)
        self.accepted.inc(stats.accepted)
        for position, (verified, accepted) in enumerate(zip(stats.verified_by_position, stats.accepted_by_position)):
            self.verified_by_position.labels(str(position + 1)).inc(verified)
            self.accepted_by_position.labels(str(position + 1)).inc(accepted)
        for source, count in stats.rounds_by_source.items():
            self.rounds_by_source.labels(source).inc(count)
        self._rounds += stats.rounds
        self._accepted += stats.accepted
        self.tau.set(SpecStats(rounds=self._rounds, accepted=self._accepted).tau)
        self.latency.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if len(result.token_ids) > 1:
                self.tpot.observe((e2e_s - ttft_s) / (len(result.token_ids) - 1))

    def queue(self, running: int, waiting: int, kv_cache: dict | None = None) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        if kv_cache is not None:  # BatchEngine.kv_cache
            self.kv_blocks_used.set(kv_cache["blocks_used"])
            self.kv_bytes_used.set(kv_cache["blocks_used"] * kv_cache["bytes_per_block"])
            if kv_cache["blocks_limit"] is not None:
                self.kv_blocks_limit.set(kv_cache["blocks_limit"])
                self.kv_usage.set(kv_cache["blocks_used"] / kv_cache["blocks_limit"])
            self.preemptions.set(kv_cache["preemptions"])
            self.prefix_blocks.set(kv_cache["prefix_blocks"])
            self.prefix_queried.set(kv_cache["prefix_queried_tokens"])
            self.prefix_hits.set(kv_cache["prefix_hit_tokens"])
            if kv_cache["prefix_queried_tokens"]:
                self.prefix_hit_rate.set(kv_cache["prefix_hit_tokens"] / kv_cache["prefix_queried_tokens"])

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
