"""The fixed mode's registry entry: how a fixed-mode model opens, and the families only it
exports.

A fixed-mode model is a :class:`~batcher.fixed.batcher.Batcher` (tier queues, flush by size or
timeout) in front of a :class:`~batcher.fixed.pool.WorkerPool` of ``run_batch`` worker processes.
What only batches have, only this mode exports::

    ferry_flushes            counter    {model, reason}  batches flushed, by the policy's reason
    ferry_batch_retries      counter    {model}          batches re-dispatched whole after a failed call
    ferry_bisections         counter    {model}          failed batches split to isolate a bad input
    ferry_batch_size         histogram  {model}          requests per flushed batch
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import AbstractAsyncContextManager

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from batcher.core.config import QueueConfig
from batcher.core.mode import Exported, Mode
from batcher.core.scaling import open_scaled
from batcher.core.tokenizer import Tokenizer
from batcher.fixed.batcher import Batcher, open_batcher
from batcher.fixed.config import FixedModelConfig
from batcher.fixed.counters import BatchCounters
from batcher.fixed.elastic import FixedFleet
from batcher.fixed.slot import Spawn
from batcher.fixed.worker import ProcessWorker

_COUNTERS = (
    ("ferry_batch_retries", "Batches re-dispatched whole after a failed call.", "retries"),
    ("ferry_bisections", "Failed batches split in two to isolate a bad input.", "bisections"),
)


def open_fixed(model: FixedModelConfig, queue: QueueConfig, spawn: Spawn, tokenizer: Tokenizer
               ) -> AbstractAsyncContextManager[Batcher]:
    """A batcher over the model's pool, pricing each prompt with the model's tokenizer, and its
    scaler if it has a range of workers or a warm pool."""
    opened = open_batcher(spawn, model.pool_config(), model.batch_policy(), queue, tokens=tokenizer.count,
                          outputs=model.outputs)
    counters = operator.attrgetter("counters")
    return open_scaled(opened, model.scaling(model.workers), FixedFleet, counters, model.name)



def batch_families(backends: Sequence[Exported[BatchCounters]]) -> Iterator[Metric]:
    """The batch families of every fixed-mode backend (see the module doc)."""
    flushes = CounterMetricFamily("ferry_flushes", "Batches flushed, by reason.", labels=["model", "reason"])
    families = [(CounterMetricFamily(name, text, labels=["model"]), field) for name, text, field in _COUNTERS]
    sizes = HistogramMetricFamily("ferry_batch_size", "Requests per flushed batch.", labels=["model"])
    for model, _, snapshot in backends:
        counters = snapshot.counters
        for reason, count in sorted(counters.flushes.items()):
            flushes.add_metric([model, reason], count)
        for family, field in families:
            family.add_metric([model], getattr(counters, field))
        sizes.add_metric([model], counters.batch_sizes.cumulative(), counters.batch_sizes.total)
    yield flushes
    yield from (family for family, _ in families)
    yield sizes


MODE = Mode(argv=operator.attrgetter("argv"), process=ProcessWorker, open=open_fixed,
            families=batch_families)
