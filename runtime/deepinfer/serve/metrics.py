"""Prometheus metrics of the server (prometheus_client, one registry per server).

Counters and histograms are updated on the engine thread as outputs arrive; gauges (running and
waiting requests, KV blocks, tokens/s over the last 10 s, the expert cache's and speculative
decoding's counters) are read from
the engine when /metrics is scraped."""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests_started = Counter("deepinfer_requests_started", "requests admitted to the engine", registry=r)
        self.requests_finished = Counter("deepinfer_requests_finished", "requests finished", ["reason"], registry=r)
        self.requests_aborted = Counter("deepinfer_requests_aborted", "requests aborted (client gone)", registry=r)
        self.requests_rejected = Counter("deepinfer_requests_rejected", "requests refused", ["status"], registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("deepinfer_time_per_output_token_seconds", "between consecutive tokens of a request",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("deepinfer_request_latency_seconds", "arrival to last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.step_time = Histogram("deepinfer_engine_step_seconds", "one engine step", registry=r,
                                   buckets=LATENCY_BUCKETS)
        self.running = Gauge("deepinfer_requests_running", "sequences holding KV blocks", registry=r)
        self.waiting = Gauge("deepinfer_requests_waiting", "sequences waiting for admission", registry=r)
        self.kv_used = Gauge("deepinfer_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("deepinfer_kv_blocks_total", "KV cache blocks", registry=r)
        self.prefix_hit = Gauge("deepinfer_prefix_cache_hit_ratio", "prompt tokens served from the prefix cache",
                                registry=r)
        self.preemptions = Gauge("deepinfer_preemptions", "sequences preempted (recomputed later)", registry=r)
        self.plans = Gauge("deepinfer_plans", "execution plans traced", registry=r)
        self.tokens_per_s = Gauge("deepinfer_generation_tokens_per_second", "tokens generated per second, last 10 s",
                                  registry=r)
        # the expert cache's counters (engine config expert_cache), present only when it is on
        self.experts = {k: Gauge(f"deepinfer_expert_cache_{k}", help_, registry=r) for k, help_ in (
            ("hits", "routed experts found resident when a step needed them"),
            ("misses", "routed experts a step had to load and wait for"),
            ("prefetch_issued", "experts loaded ahead of use on a prediction"),
            ("prefetch_used", "prefetched experts a step then used"),
            ("bytes_streamed", "expert bytes copied into the cache"),
            ("wait_seconds", "time steps waited for expert loads"),
            ("pause_free_steps", "decode steps run without pauses (every expert in place)"),
            ("pause_free_retries", "pause-free steps that missed an expert and were run again with pauses"))}
        self.expert_hit_ratio = Gauge("deepinfer_expert_cache_hit_ratio", "hits / needed experts", registry=r)
        # speculative decoding (engine config speculative), present only when it is on
        self.spec = {k: Gauge(f"deepinfer_spec_{k}", help_, registry=r) for k, help_ in (
            ("steps", "speculative steps (drafts verified)"),
            ("plain_steps", "decode steps the scheduler ran without speculation"),
            ("drafts_verified", "draft tokens verified"),
            ("drafts_accepted", "draft tokens accepted"),
            ("mean_accepted_length", "tokens a sequence gains per speculative step"),
            ("verify_tokens_per_step", "rows of a speculative step"))}
        self.spec_acceptance = Gauge("deepinfer_spec_acceptance", "acceptance rate of a draft position",
                                     ["position"], registry=r)
        self._recent: deque = deque()
        self._lock = threading.Lock()

    def note_tokens(self, now: float, n: int) -> None:
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()

    def render(self, snapshot: dict) -> bytes:
        self.running.set(snapshot["running"])
        self.waiting.set(snapshot["waiting"])
        self.kv_used.set(snapshot["kv_blocks_used"])
        self.kv_total.set(snapshot["kv_blocks_total"])
        q = snapshot["prefix_cache_query_tokens"]
        self.prefix_hit.set(snapshot["prefix_cache_hit_tokens"] / q if q else 0.0)
        self.preemptions.set(snapshot["preemptions"])
        self.plans.set(snapshot["plans"])
        if "expert_hits" in snapshot:
            for k, g in self.experts.items():
                g.set(snapshot[f"expert_{k}"])
            self.expert_hit_ratio.set(snapshot["expert_hit_rate"] or 0.0)
        if "spec_steps" in snapshot:
            for k, g in self.spec.items():
                g.set(snapshot[f"spec_{k}"] or 0.0)
            for i, a in enumerate(snapshot["spec_acceptance_per_position"]):
                self.spec_acceptance.labels(position=str(i + 1)).set(a or 0.0)
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()
            self.tokens_per_s.set(sum(n for _, n in self._recent) / 10.0)
        return generate_latest(self.registry)
