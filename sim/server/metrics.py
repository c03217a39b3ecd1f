"""`/metrics` in Prometheus text with vLLM v1's metric names and labels.

Names and labels follow vLLM's `vllm/v1/metrics/loggers.py` (PrometheusStatLogger): every series
carries `model_name` and `engine` ("0": one engine core per server); `vllm:request_success_total`
adds `finished_reason`; `vllm:cache_config_info` is an info-style gauge fixed at 1 whose labels are
the cache config (plus `engine`). Values are read from the engine core on each scrape (a custom
collector over a per-app registry), so they are exactly the core's counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sim.engine.core import EngineStats
from sim.engine.request import FinishReason
from sim.server.lora import LoraState

ENGINE_INDEX = "0"


@dataclass(frozen=True, slots=True)
class CacheConfigInfo:
    """The labels vLLM's CacheConfig.metrics_info() exposes that the simulator can fill."""

    block_size: int
    num_gpu_blocks: int

    def labels(self) -> dict[str, str]:
        return {
            "block_size": str(self.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sha256",
            "engine": ENGINE_INDEX,
        }


class EngineCollector(Collector):
    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats],
                 cache_info: CacheConfigInfo, lora: LoraState | None = None) -> None:
        self._model_name = model_name
        self._read_stats = read_stats
        self._cache_info = cache_info
        self._lora = lora

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        labels = ["model_name", "engine"]
        values = [self._model_name, ENGINE_INDEX]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    stats.kv_usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      stats.prefix_queries_total)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      stats.prefix_hits_total)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.num_preemptions_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.generation_tokens_total)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for reason in FinishReason:
            success.add_metric([*values, str(reason)],
                               stats.requests_finished_total.get(reason, 0))
        yield success
        info_labels = self._cache_info.labels()
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=list(info_labels))
        info.add_metric(list(info_labels.values()), 1.0)
        yield info
        if self._lora is not None:  # vLLM's: labels only, the value is when they were taken
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters",
                                             "running_lora_adapters"])
            lora.add_metric([str(self._lora.max_loras), ",".join(self._lora.waiting),
                             ",".join(self._lora.running)], time.time())
            yield lora


def build_registry(model_name: str, read_stats: Callable[[], EngineStats],
                   cache_info: CacheConfigInfo, lora: LoraState | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(model_name, read_stats, cache_info, lora))
    return registry
