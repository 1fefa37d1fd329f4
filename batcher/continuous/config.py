"""A continuous-mode model table: its engine workers (ferry's engine, vLLM's, or a simulated one),
their KV cache and step budget, and the router's and supervision's settings."""

from __future__ import annotations

import dataclasses
import math
import os

from batcher.continuous.silence import SilenceLimit
from batcher.core.config import ModelConfig, PoolConfig, require
from workers.engine.config import DEFAULTS, DTYPE, DTYPES, THREADS, WEIGHTS

CONVERTED = ("smollm2-135m",)
"""Model names ``ferry serve`` converts once from an installed GGUF (workers/convert.py)."""
SIMULATED = ("llama-70b", "smollm2-135m")  # workers/engine/cost_model.py: PRESETS
ENGINES = ("ferry", "vllm")
"""Who runs a continuous model's steps: ferry's own engine, or vLLM's (``workers/vllm_engine.py``,
under an interpreter that has vLLM: its own virtualenv, named by ``python``)."""

LOSS_RULES = ("error", "resume")
"""What becomes of a stream that has shown text when its engine dies: it ends with a retryable
error, or it goes on where it was on another engine (docs/continuous.md, "Streams that survive")."""


def converted_dir(name: str) -> str:
    """Where the conversion of a :data:`CONVERTED` model lives (what ``--model`` is given)."""
    from workers.convert import SOURCES, models_dir  # numpy only; never gguf or torch here

    return str(models_dir() / SOURCES[name].dir_name)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ContinuousModelConfig(ModelConfig):
    """A continuous-mode model: engine workers (``python -m workers engine``) behind the router.

    ``model`` is a Hugging Face model directory, or a name in :data:`CONVERTED` (converted once
    at start); ``simulated`` instead names a cost-model preset (no weights: seeded tokens, each
    step as long as the preset's GPU would take; ids are ASCII under the ``bytes`` tokenizer).
    ``tokenizer`` and ``chat_template`` default to the model's own (``bytes`` and ``labelled``
    for a simulated engine).
    """

    mode: str = "continuous"
    model: str = ""
    simulated: str = ""
    tokenizer: str = ""
    chat_template: str = ""
    workers: int = 1  # engine replicas, one per GPU
    block_size: int = DEFAULTS.block_size  # tokens per KV block
    num_blocks: int = 0  # KV blocks per replica (0: from kv_memory_gb, else the runner's default)
    kv_memory_gb: float = 0.0  # KV cache size per replica, instead of num_blocks
    max_batch_tokens: int = DEFAULTS.max_batch_tokens  # the token budget of one engine step
    max_seqs: int = DEFAULTS.max_seqs  # running sequences per replica at most
    dtype: str = DTYPE
    device: str = ""  # cpu or cuda (default: cuda where present)
    threads: int = THREADS  # torch CPU threads per engine
    weights: str = WEIGHTS[0]  # ferry's engine in bfloat16 on a CPU: "int8" too, for steps of few rows
    compile: bool = False  # engine = "vllm": torch.compile the model (a slower start, faster steps)
    affinity_bound: int = 2048  # tokens: a prefix holder busier than the least loaded by more loses it
    stats_timeout_ms: float = 5000.0  # an engine silent this long (no stats frame) is dead: killed
    max_step_ms: float = 60_000.0  # the most silence a step the engine announced as long is allowed
    start_timeout_ms: float = 120_000.0  # an engine not ready this long after spawn did not start
    max_attempts: int = 3  # a request whose engine died under it this many times fails (500)
    temperature: float = 1.0  # of a request that names none (the Messages API's default); 0: greedy
    engine: str = "ferry"  # a name in ENGINES
    on_engine_loss: str = "error"  # a stream that showed text when its engine died: "error" or "resume"
    step_costs: str = ""  # a file `ferry fit` wrote: the prices that hold the tiers' tpot_target_ms
    prefill_workers: int = 0  # with decode_workers, instead of workers: replicas that prefill and hand off
    decode_workers: int = 0  # replicas that decode what the prefill ones hand them (0, 0: colocated)
    # the long-prompt pool (docs/continuous.md, "A pool for long prompts"): prompts longer than
    # long_prompt_tokens go to long_workers replicas of their own, sized apart (0: as the others)
    long_prompt_tokens: int = 0  # 0: no long pool
    long_workers: int = 0
    long_num_blocks: int = 0
    long_kv_memory_gb: float = 0.0
    long_max_batch_tokens: int = 0

    def __post_init__(self) -> None:
        require(bool(self.model) != bool(self.simulated), "model", "a model (or simulated), not both",
                 self.model or self.simulated or "neither")
        if self.simulated:
            require(self.simulated in SIMULATED, "simulated", f"one of {list(SIMULATED)}", self.simulated)
        elif self.model not in CONVERTED:
            path = os.path.expanduser(self.model)
            require(os.path.isfile(os.path.join(path, "config.json")), "model",
                     f"one of {list(CONVERTED)} or a Hugging Face model directory", self.model)
        own = self.model_dir
        if not self.tokenizer:
            object.__setattr__(self, "tokenizer", own or "bytes")
        if not self.chat_template:
            object.__setattr__(self, "chat_template", "model" if own else "labelled")
        super(ContinuousModelConfig, self).__post_init__()
        for name in ("block_size", "max_batch_tokens", "max_seqs"):
            require(1 <= getattr(self, name) <= 1 << 20, name, "1..1048576", getattr(self, name))
        require(
            self.max_seqs <= self.max_batch_tokens,
            "max_seqs",
            f"<= max_batch_tokens ({self.max_batch_tokens})",
            self.max_seqs,
        )
        require(self.num_blocks >= 0, "num_blocks", ">= 0", self.num_blocks)
        require(0 <= self.kv_memory_gb < math.inf, "kv_memory_gb", "GiB >= 0", self.kv_memory_gb)
        require(
            not (self.num_blocks and self.kv_memory_gb),
            "kv_memory_gb",
            "num_blocks or kv_memory_gb, not both",
            self.kv_memory_gb,
        )
        require(self.dtype in DTYPES, "dtype", f"one of {list(DTYPES)}", self.dtype)
        require(self.device in ("", "cpu", "cuda"), "device", "'cpu' or 'cuda'", self.device)
        require(1 <= self.threads <= 1024, "threads", "1..1024", self.threads)
        require(self.affinity_bound >= 0, "affinity_bound", "tokens >= 0", self.affinity_bound)
        require(
            0 < self.stats_timeout_ms < math.inf,
            "stats_timeout_ms",
            "milliseconds > 0",
            self.stats_timeout_ms,
        )
        require(0 < self.max_step_ms < math.inf, "max_step_ms", "milliseconds > 0", self.max_step_ms)
        require(0 < self.start_timeout_ms < math.inf, "start_timeout_ms", "milliseconds > 0",
                self.start_timeout_ms)
        require(0.0 <= self.temperature <= 1.0, "temperature", "a number in 0..1", self.temperature)
        require(self.engine in ENGINES, "engine", f"one of {list(ENGINES)}", self.engine)
        require(self.engine == "ferry" or not self.simulated, "engine", "'ferry' for a simulated model",
                 self.engine)
        require(self.on_engine_loss in LOSS_RULES, "on_engine_loss", f"one of {list(LOSS_RULES)}",
                self.on_engine_loss)
        require(self.on_engine_loss == "error" or self.engine == "ferry", "on_engine_loss",
                "'error' unless engine = \"ferry\" (vLLM's seeded sampling cannot resume a sequence)",
                self.on_engine_loss)
        if self.step_costs:
            require(self.engine == "ferry", "step_costs", "'' unless engine = \"ferry\"", self.step_costs)
            require(os.path.isfile(os.path.expanduser(self.step_costs)), "step_costs",
                    "a file `ferry fit` wrote (its engines read it at start)", self.step_costs)
        require(self.weights in WEIGHTS, "weights", f"one of {list(WEIGHTS)}", self.weights)
        int8_runs = self.engine == "ferry" and self.dtype == "bfloat16" and self.device != "cuda"
        require(self.weights == WEIGHTS[0] or (int8_runs and not self.simulated), "weights",
                "'bf16' unless ferry's engine runs a real model in bfloat16 on a CPU", self.weights)
        require(not self.compile or self.engine == "vllm", "compile", "false unless engine = \"vllm\"",
                 self.compile)
        self._check_roles()
        self._check_long_pool()
        self.pool_config()  # checks workers and max_attempts with the pool's own rules

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on separate replicas (docs/continuous.md, "Prefill and decode apart")."""
        return bool(self.prefill_workers or self.decode_workers)

    def _check_roles(self) -> None:
        """``prefill_workers`` and ``decode_workers`` together, each >= 1, in place of ``workers``
        (which becomes their sum), on ferry's engine over a model, at a fixed size, without a
        long-prompt pool."""
        if not self.disaggregated:
            return
        for name in ("prefill_workers", "decode_workers"):
            count = getattr(self, name)
            require(1 <= count <= 4096, name, "1..4096 (with the other one)", count)
        total = self.prefill_workers + self.decode_workers
        require(self.workers in (1, total), "workers",
                f"left out with prefill_workers and decode_workers (it is their sum, {total})", self.workers)
        object.__setattr__(self, "workers", total)
        require(self.engine == "ferry" and not self.simulated, "prefill_workers",
                "0 unless ferry's engine runs a model (vLLM's and the simulated engine hand no KV over)",
                self.prefill_workers)
        require(not self.scaling(total).elastic, "prefill_workers",
                "0 with min_workers, max_workers or warm_workers (a pool of two roles does not scale)",
                self.prefill_workers)
        require(not self.long_workers, "prefill_workers",
                "0 with long_workers (a pool of two roles has no long-prompt pool)", self.prefill_workers)

    def _check_long_pool(self) -> None:
        """The long-prompt pool's keys: both or neither of a threshold and its replicas; sizes
        only with replicas to size."""
        require(0 <= self.long_prompt_tokens < self.context_window, "long_prompt_tokens",
                f"tokens in 0..context_window ({self.context_window}), 0 for no long pool",
                self.long_prompt_tokens)
        require(0 <= self.long_workers <= 4096, "long_workers", "0..4096", self.long_workers)
        require(bool(self.long_prompt_tokens) == bool(self.long_workers),
                "long_workers" if self.long_prompt_tokens else "long_prompt_tokens",
                "long_prompt_tokens > 0 and long_workers >= 1 together (a long pool needs both)",
                self.long_workers if self.long_prompt_tokens else self.long_prompt_tokens)
        sized = {"long_num_blocks": self.long_num_blocks, "long_kv_memory_gb": self.long_kv_memory_gb,
                 "long_max_batch_tokens": self.long_max_batch_tokens}
        for name, value in sized.items():
            require(not value or self.long_workers > 0, name, "0 unless long_workers >= 1", value)
        budget = self.long_max_batch_tokens
        require(not budget or self.max_seqs <= budget <= 1 << 20, "long_max_batch_tokens",
                f"max_seqs ({self.max_seqs})..1048576, 0 for max_batch_tokens", budget)
        require(self.long_num_blocks >= 0, "long_num_blocks", ">= 0", self.long_num_blocks)
        require(0 <= self.long_kv_memory_gb < math.inf, "long_kv_memory_gb", "GiB >= 0",
                self.long_kv_memory_gb)
        require(not (self.long_num_blocks and self.long_kv_memory_gb), "long_kv_memory_gb",
                "long_num_blocks or long_kv_memory_gb, not both", self.long_kv_memory_gb)

    def long_table(self) -> ContinuousModelConfig:
        """The table of the long pool's replicas: this one with their own KV cache and step
        budget (each the ordinary replicas' where 0), ``long_workers`` of them, never scaled."""
        own_cache = bool(self.long_num_blocks or self.long_kv_memory_gb)
        num_blocks, kv_memory_gb = ((self.long_num_blocks, self.long_kv_memory_gb) if own_cache
                                    else (self.num_blocks, self.kv_memory_gb))
        return dataclasses.replace(
            self, workers=max(1, self.long_workers), num_blocks=num_blocks, kv_memory_gb=kv_memory_gb,
            max_batch_tokens=self.long_max_batch_tokens or self.max_batch_tokens,
            long_prompt_tokens=0, long_workers=0, long_num_blocks=0, long_kv_memory_gb=0.0,
            long_max_batch_tokens=0, min_workers=None, max_workers=None, warm_workers=0)

    @property
    def model_dir(self) -> str:
        """The directory the engines load ('' for a simulated engine)."""
        if self.simulated:
            return ""
        return converted_dir(self.model) if self.model in CONVERTED else os.path.expanduser(self.model)

    def _check_files(self) -> None:
        if self.model not in CONVERTED:  # else written at start, checked when the gateway loads them
            super(ContinuousModelConfig, self)._check_files()

    def silence(self) -> SilenceLimit:
        """How long an engine may go unheard: ``stats_timeout_ms`` between steps, up to
        ``max_step_ms`` during a step it announced as long (``batcher.continuous.silence``)."""
        return SilenceLimit(self.stats_timeout_ms / 1000, self.max_step_ms / 1000)

    def pool_config(self) -> PoolConfig:
        """Supervision of the engines: an engine silent for ``stats_timeout_ms`` is hung. A
        model that scales has a slot for every replica it may hold, ``min_workers`` started."""
        PoolConfig(self.workers)  # `workers` by the pool's own rules, whatever the scaler's keys say
        scaling = self.scaling(self.workers)
        workers, initial = (scaling.slots, scaling.min_workers) if scaling.elastic else (self.workers, None)
        return PoolConfig(workers, self.stats_timeout_ms / 1000, self.max_attempts, model=self.name,
                          initial=initial, start_timeout=self.start_timeout_ms / 1000)

    def conversion_argv(self) -> list[str] | None:
        """``python -m`` arguments that convert this model into :attr:`model_dir` once (a
        :data:`CONVERTED` name; a later run finds it done in a fraction of a second), or None
        when there is nothing to convert."""
        if self.simulated or self.model not in CONVERTED:
            return None
        return ["workers.convert", self.model, "--out", self.model_dir]

    def engine_argv(self) -> list[str]:
        """``python -m workers`` arguments of one engine worker."""
        if self.simulated:
            argv = ["engine", "--simulated", self.simulated]
            if self.tokenizer == "bytes":
                argv += ["--sim-vocab", "128"]  # ASCII: one character a token
        else:
            kind = "engine" if self.engine == "ferry" else "vllm-engine"
            argv = [kind, "--model", self.model_dir, "--dtype", self.dtype, "--threads", str(self.threads)]
            if self.engine == "vllm":
                argv += ["--max-model-len", str(self.context_window)]
                argv += ["--compile"] if self.compile else []
            elif self.weights != WEIGHTS[0]:
                argv += ["--weights", self.weights]
        argv += ["--block-size", str(self.block_size), "--max-batch-tokens", str(self.max_batch_tokens),
                 "--max-seqs", str(self.max_seqs), "--model-version", self.name]
        if self.prefill_workers:
            argv += ["--prefill-slots", str(self.prefill_workers)]  # slots 0..P-1 prefill, the rest decode
            if self.placement == "local":  # every engine on the gateway's host: KV through /dev/shm
                argv += ["--kv-shm"]
        if self.num_blocks:
            argv += ["--num-blocks", str(self.num_blocks)]
        elif self.kv_memory_gb:
            argv += ["--kv-memory-gb", str(self.kv_memory_gb)]
        if self.device:
            argv += ["--device", self.device]
        if self.step_costs:
            argv += ["--step-costs", os.path.expanduser(self.step_costs)]
        return argv

    def check_tpot_targets(self) -> None:
        """Its engines hold the tiers' TPOT targets only as ferry's engine with prices for its
        steps: its ``step_costs``, or a simulated engine's preset."""
        require(self.engine == "ferry", "engine", "'ferry' where a tier sets tpot_target_ms", self.engine)
        require(bool(self.simulated or self.step_costs), "step_costs",
                "a file `ferry fit` wrote, where a tier sets tpot_target_ms", self.step_costs)


CONFIG = ContinuousModelConfig
