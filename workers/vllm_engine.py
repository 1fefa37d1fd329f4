"""``python -m workers vllm-engine``: vLLM's engine behind ferry's framed pipe, so a model with
``engine = "vllm"`` is scheduled, routed, admitted, streamed, metered and supervised exactly as one
on ferry's own engine.

It runs vLLM's ``LLMEngine`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core
child, so a SIGKILL of this process is the death of the engine, which is what the pool's failure
rule expects), never its HTTP server. It runs under the interpreter of vLLM's own virtualenv
(``make vllm-env``): it imports nothing of ferry but this package's pure modules and the frame
codec, and vLLM only once the command line is parsed.

The frames are ferry's engine's (``workers/protocol.py``, ``workers/engine/serve.py``)::

    add {rid, ...}   -> LLMEngine.add_request(str(rid), prompt ids, SamplingParams: every field of
                        ferry's Sampling, penalties, min_p and logit_bias included); a prompt vLLM
                        refuses (longer than max_model_len) finishes at once as too_long
    abort {rid}      -> abort_request; finished {aborted} at once (vLLM reports nothing for it)
    a long step      -> step {seconds} as it starts: what the adapter expects vLLM to compute
                        (workers/vllm_step.py), priced by the steps it timed (StepForecast)
    each step        -> tokens {rid, ids}: the step's new id (vLLM asked for deltas, ids only: the
                        gateway detokenizes), then finished; a stop token (EOS or a stop id)
                        is not sent, and counted in the usage, as ferry's engine does
    every ~200 ms    -> stats, from vLLM's own scheduler stats (``get_metrics``)

Blocks in ``stats`` are counted in ``--block-size`` tokens, ferry's unit (the pool sizes requests
with it), whatever vLLM's own block is (its CPU attention wants multiples of 32; it picks 128):
``total_blocks`` is vLLM's KV capacity in tokens over that size, ``used_blocks`` its usage share
of it. vLLM does not count its evictable prefix blocks, so ``cached_blocks`` is 0. The prefix
cache is on, salted with the model version and the tenant (one tenant's prompts never speed up
another's: no timing side channel between them), as ferry's engine keys its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from workers.engine.interface import SequenceEnd, StepOutput, StepWatch
from workers.engine.loop import STOPS
from workers.engine.sequence import FinishReason
from workers.engine.serve import BAD_START, serve
from workers.protocol import EngineStats, Usage
from workers.sampling import Sampling
from workers.vllm_step import Live, step_lengths

ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process (see the module doc)
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",  # a local model directory; never the network
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # no HTTP frontend here to keep a core for
}


METRICS = {  # vLLM's scheduler stats (engine 0: the only one in process) -> the stats frame's fields
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:generation_tokens": "generated_tokens",
}


def read_metrics(metrics: Iterable[Any]) -> tuple[dict[str, int], float]:
    """vLLM's ``get_metrics()`` as the stats frame's fields (computed tokens: the prompt tokens it
    computed itself, not taken from the cache, and every decode), and its KV usage share."""
    fields, usage, computed_prompt = dict.fromkeys(METRICS.values(), 0), 0.0, 0
    for metric in metrics:
        if metric.name in METRICS:
            fields[METRICS[metric.name]] = int(metric.value)
        elif metric.name == "vllm:kv_cache_usage_perc":
            usage = float(metric.value)
        elif metric.name == "vllm:prompt_tokens_by_source" and metric.labels.get("source") == "local_compute":
            computed_prompt = int(metric.value)
    fields["computed_tokens"] = computed_prompt + fields["generated_tokens"]
    return fields, usage


class VllmEngine:
    """vLLM's ``LLMEngine`` as an :class:`~workers.engine.interface.EngineCore`, so that ferry's
    serving loop (:mod:`workers.engine.loop`, in :func:`workers.engine.serve.run`) serves it
    frame for frame as it serves its own engine."""

    def __init__(self, engine: Any, sampling: Callable[..., Any], delta: object, block_size: int,
                 salt: str) -> None:
        self.engine, self._sampling, self._delta, self.salt = engine, sampling, delta, salt
        cache = engine.vllm_config.cache_config
        self.step_budget = engine.vllm_config.scheduler_config.max_num_batched_tokens  # tokens a step
        self.total_blocks = cache.num_gpu_blocks * cache.block_size // block_size
        tokenizer = engine.get_tokenizer()
        self._eos = frozenset(i for i in (tokenizer.eos_token_id,) if i is not None)
        self.live: dict[int, Live] = {}
        self.steps = 0
        self._ended: list[SequenceEnd] = []  # aborted or refused since the last step

    @property
    def has_work(self) -> bool:
        return bool(self.live or self._ended)

    def add(self, prompt_ids: list[int], sampling: Sampling, *, tier: int = 0, tenant: str = "",
            rid: int | None = None, weight: float = 1.0, output_ids: Sequence[int] = (),
            tpot_target: float = 0.0) -> int:
        """Queue ``rid`` in vLLM; one it refuses (longer than its max_model_len) ends as too_long.
        vLLM's own scheduler orders its queue: the tenant's ``weight`` is the gateway's to apply,
        and it holds no ``tpot_target`` (a tier that sets one needs ferry's engine).
        A resumed sequence (``output_ids``) is refused: vLLM's seeded sampling cannot continue one
        (docs/continuous.md, "Streams that survive")."""
        if rid is None or rid in self.live or not prompt_ids or output_ids:
            raise ValueError(f"rid {rid}: a new rid and a prompt are needed, and no output to resume")
        params = self._sampling(  # ids only, each step's new ones: the gateway detokenizes
            max_tokens=sampling.max_tokens, temperature=sampling.temperature or 0.0, top_p=sampling.top_p,
            top_k=sampling.top_k, min_p=sampling.min_p, seed=sampling.seed,
            presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty, logit_bias=dict(sampling.logit_bias) or None,
            stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos, detokenize=False,
            output_kind=self._delta,
        )
        prompt = {"prompt_token_ids": list(prompt_ids), "cache_salt": f"{self.salt}\0{tenant}"}
        try:
            self.engine.add_request(str(rid), prompt, params)
        except ValueError as exc:
            refused = SequenceEnd(rid, FinishReason.TOO_LONG, Usage(len(prompt_ids), 0, 0), str(exc))
            self._ended.append(refused)
            return rid
        stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self._eos)
        self.live[rid] = Live(len(prompt_ids), stops)
        return rid

    def abort(self, rid: int) -> bool:
        """End ``rid`` (False if unknown); vLLM frees its blocks at once and reports nothing more."""
        seq = self.live.pop(rid, None)
        if seq is None:
            return False
        self.engine.abort_request([str(rid)])
        self._ended.append(SequenceEnd(rid, FinishReason.ABORTED, seq.usage))
        return True

    def step(self, watch: StepWatch | None = None) -> StepOutput:
        """One vLLM step: each sequence's new token, and what ended. vLLM schedules inside its own
        step, so ``watch`` is told what the adapter expects it to compute, erring long
        (:func:`workers.vllm_step.step_lengths`); the watch's timing of real steps corrects the rest."""
        tokens: dict[int, int] = {}
        finished, self._ended = self._ended, []
        outputs: list[Any] = []
        if self.live:
            if watch is not None:
                watch.begin(*step_lengths(self.live.values(), self.step_budget))
            outputs = self.engine.step()
            if watch is not None:
                watch.end()
        self.steps += 1
        for output in outputs:
            seq = self.live.get(rid := int(output.request_id))
            if seq is None:  # aborted meanwhile: its end is reported already
                continue
            seq.cached = output.num_cached_tokens or seq.cached
            completion = output.outputs[0]
            new = completion.token_ids  # this step's ids only (RequestOutputKind.DELTA)
            if len(new) > 1:
                raise RuntimeError(f"rid {rid}: {len(new)} tokens in one step (speculative decoding?)")
            if new:
                tokens[rid] = new[-1]
                seq.shown += 1
            if output.finished:
                del self.live[rid]
                reason = self._reason(completion.finish_reason, completion.stop_reason)
                if reason in STOPS and (not new or new[-1] not in seq.stop_ids):
                    seq.shown += 1  # vLLM left the stop id out: ferry's usage counts it all the same
                finished.append(SequenceEnd(rid, reason, seq.usage))
        return StepOutput(tokens, finished, [], len(tokens))

    def stats(self) -> EngineStats:
        fields, usage = read_metrics(self.engine.get_metrics())
        if not self.live:  # vLLM's gauges are from its last step; an abort since then freed what it held
            fields.update(running=0, waiting=0)
            usage = 0.0
        used = min(self.total_blocks, round(usage * self.total_blocks))
        free = self.total_blocks - used
        return EngineStats(step=self.steps, free_blocks=free, used_blocks=used,
                           total_blocks=self.total_blocks, cached_blocks=0, **fields)

    @staticmethod
    def _reason(finish_reason: str | None, stop_reason: object) -> FinishReason:
        """vLLM's finish reason in ferry's words."""
        if finish_reason == "length":
            return FinishReason.MAX_TOKENS
        if finish_reason == "abort":
            return FinishReason.ABORTED
        return FinishReason.STOP_TOKEN if isinstance(stop_reason, int) else FinishReason.EOS


def load_engine(args: argparse.Namespace) -> VllmEngine:
    """vLLM's engine as the command line asks for it (the slow part of the start)."""
    if args.threads < 1:
        raise ValueError(f"--threads: expected >= 1, got {args.threads}")
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # In process, vLLM takes this process for a frontend and cuts torch to one thread unless told
    # how many (OMP_NUM_THREADS): the model table's thread count, as for ferry's engine.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from vllm import SamplingParams as VllmSampling
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.llm_engine import LLMEngine
    from vllm.sampling_params import RequestOutputKind

    size: dict[str, int] = {}
    if args.kv_memory_gb:
        size["kv_cache_memory_bytes"] = int(args.kv_memory_gb * (1 << 30))
    engine_args = EngineArgs(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_batch_tokens, max_num_seqs=args.max_seqs,
        enable_prefix_caching=True, enforce_eager=not args.compile, disable_log_stats=False, **size,
    )
    if args.num_blocks:  # in vLLM's own blocks, once it has chosen their size
        probe = engine_args.create_engine_config()
        vllm_block = probe.cache_config.block_size
        engine_args.num_gpu_blocks_override = -(-args.num_blocks * args.block_size // vllm_block)
    engine = LLMEngine.from_engine_args(engine_args)
    name = os.path.basename(os.path.normpath(args.model))
    salt = args.model_version or name
    return VllmEngine(engine, VllmSampling, RequestOutputKind.DELTA, args.block_size, salt)


def vllm_main(args: argparse.Namespace, protocol_in: int, protocol_out: int) -> int:
    try:
        engine = load_engine(args)
    except (ValueError, RuntimeError) as exc:
        print(f"vllm engine worker: {exc}", file=sys.stderr)
        return BAD_START
    name = os.path.basename(os.path.normpath(args.model))
    return serve(engine, name, protocol_in, protocol_out, "vllm engine worker")
