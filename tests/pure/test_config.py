"""The configuration file: the example in examples/ loads, the embedded default is what the issue
asks for, and every mistake names the file and the field."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib

import pytest

from batcher.continuous.config import converted_dir
from batcher.core.config import Outputs, PoolConfig, QueueConfig, installed_path
from gateway import cli
from gateway.config import SOURCE_ROOT, default_config, load_config, parse_config
from tests.support.minimal_config import MINIMAL

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "ferry.toml"


def test_the_example_file_loads_with_every_field():
    config = load_config(EXAMPLE)
    assert (config.server.host, config.server.port, config.server.max_body_bytes) == (
        "127.0.0.1",
        8080,
        4 << 20,
    )
    assert [(t.name, t.wait_budget_ms) for t in config.tiers] == [("paid", 1000), ("free", 300)]
    assert config.queue() == QueueConfig(
        tiers=("paid", "free"), wait_budgets=(1.0, 0.3), weights={"acme": 4.0})
    acme, hobbyist = config.keys
    assert (acme.tenant, acme.tier, acme.tokens_per_minute) == ("acme", "paid", 400000)
    assert hobbyist.key is None and hobbyist.digest == hashlib.sha256(b"sk-example-hobbyist-0002").hexdigest()
    fixed, echo, minilm, canary, smollm2 = config.models
    assert (fixed.name, fixed.aliases, fixed.mode, fixed.worker) == (
        "ferry-fixed@1", (), "fixed", ("sleep", "--latency-ms", "200"))
    assert (fixed.max_batch, fixed.max_wait_ms, fixed.context_window, fixed.tokenizer) == (
        50,
        150,
        8192,
        "bytes",
    )
    assert fixed.pool_config() == PoolConfig(workers=8, hang_timeout=1.0, max_attempts=3,
                                             model="ferry-fixed@1")
    assert (echo.name, echo.workers, echo.max_wait_ms) == ("echo@1", 2, 5)
    assert (canary.name, canary.policy) == ("ferry-fixed@2", "idle_aware")
    assert (minilm.worker, minilm.pythonpath, minilm.worker_options) == (
        "minilm:MiniLM", (str(EXAMPLE.parent / "embeddings"),), {"threads": 1})
    assert minilm.outputs == Outputs("embedding", 384)
    [alias] = config.aliases
    assert (alias.name, alias.weights) == ("ferry-fixed", (("ferry-fixed@1", 95), ("ferry-fixed@2", 5)))
    assert config.admin.socket == "" and config.admin_socket().endswith("/admin.sock")
    assert (smollm2.mode, smollm2.model, smollm2.kv_memory_gb, smollm2.affinity_bound) == (
        "continuous", "smollm2-135m", 0.5, 2048)
    assert (smollm2.gpu_hour_price, smollm2.worker_hour_price, fixed.worker_hour_price) == (2.5, 2.5, 0.0)
    assert smollm2.engine_argv() == [
        "engine", "--model", converted_dir("smollm2-135m"), "--dtype", "float32", "--threads", "1",
        "--block-size", "16", "--max-batch-tokens", "512", "--max-seqs", "256",
        "--model-version", "smollm2-135m-instruct@1", "--kv-memory-gb", "0.5"]
    table = "mode = 'continuous'\nmodel = 'smollm2-135m'\ndtype = 'bfloat16'\nweights = 'int8'"
    int8 = parse_config(MINIMAL.replace('worker = ["echo"]', table))
    assert int8.models[0].engine_argv()[5:9] == ["--threads", "1", "--weights", "int8"]
    assert smollm2.pool_config() == PoolConfig(workers=1, hang_timeout=5.0, max_attempts=3,
                                        model="smollm2-135m-instruct@1")


def test_the_embedded_default_is_8_sleep_workers_smollm2_and_minilm_on_loopback_with_two_demo_keys():
    config = default_config()
    assert config.server.host == "127.0.0.1"
    model, smollm2, minilm = config.models
    assert (model.name, model.workers, model.worker) == ("ferry-fixed@1", 8, ("sleep", "--latency-ms", "200"))
    assert (model.max_batch, model.max_wait_ms) == (50, 150)
    assert (smollm2.name, smollm2.mode, smollm2.model, smollm2.workers) == (
        "smollm2-135m-instruct@1", "continuous", "smollm2-135m", 1)
    directory = converted_dir("smollm2-135m")  # converted at the first start: the gateway reads its tokenizer
    assert (smollm2.model_dir, smollm2.tokenizer, smollm2.chat_template) == (directory, directory, "model")
    assert smollm2.engine_argv()[:3] == ["engine", "--model", directory]
    # silent 5 s between steps is hung; a step the engine announced as long, 2 minutes at most
    assert (smollm2.stats_timeout_ms, smollm2.max_step_ms) == (5000, 120_000)
    assert sorted(key.tier for key in config.keys) == ["free", "paid"]
    assert all(key.key for key in config.keys)
    examples = os.path.join(SOURCE_ROOT, "examples", "embeddings")  # user code, outside ferry's packages
    assert minilm.argv == ["model", "minilm:MiniLM", "--pythonpath", examples, "--options", '{"threads": 1}']
    assert minilm.outputs == Outputs("embedding", 384) and minilm.workers == 2
    assert os.path.isfile(os.path.join(installed_path(minilm.tokenizer), "tokenizer.json"))


def test_a_minimal_file_takes_the_defaults():
    config = parse_config(MINIMAL)
    assert config.server.port == 8080 and config.keys == ()
    assert config.models[0].pool_config() == PoolConfig(model=config.models[0].name)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[tiers]\n", "f.toml: not valid TOML"),
        ("[other]\n" + MINIMAL, "f.toml: unknown table 'other'"),
        ("[server]\nport = 70000\n" + MINIMAL, "f.toml: server.port: expected 0..65535, got 70000"),
        ("[server]\nport = '80'\n" + MINIMAL, "f.toml: server.port: expected int, got '80'"),
        ("[server]\nprot = 80\n" + MINIMAL, "f.toml: server: unknown field 'prot'"),
        (
            "[server]\nheader_timeout_ms = 0\n" + MINIMAL,
            "f.toml: server.header_timeout_ms: expected milliseconds > 0",
        ),
        (
            "[server]\nmax_connections = 0\n" + MINIMAL,
            "f.toml: server.max_connections: expected 1..1000000, got 0",
        ),
        ("server = 1\n" + MINIMAL, "f.toml: server: expected a table, got 1"),
        ("tiers = 1\n", "f.toml: tiers: expected an array of tables"),
        ("[[models]]\nname = 'm'\nworker = ['echo']\n", "f.toml: tiers: expected at least one tier"),
        ("[[tiers]]\nname = 'paid'\n", "f.toml: models: expected at least one model"),
        (MINIMAL + "max_batch = 0\n", "f.toml: models[0].max_batch: expected 1..1024, got 0"),
        (MINIMAL + "workers = 0\n", "f.toml: models[0].workers: expected 1..4096, got 0"),
        (MINIMAL + "workers = true\n", "f.toml: models[0].workers: expected int, got True"),
        (MINIMAL + "hang_timeout_ms = 0\n", "f.toml: models[0].hang_timeout_ms: expected milliseconds > 0"),
        (MINIMAL + "mode = 'streaming'\n", "f.toml: models[0].mode: expected one of ['continuous', 'fixed']"),
        (
            MINIMAL + "tokenizer = 'bpe'\n",
            "f.toml: models[0].tokenizer: expected 'bytes' or a path to a tokenizer.json",
        ),
        (MINIMAL + "context_window = 0\n", "f.toml: models[0].context_window: expected 1..16777216"),
        (
            MINIMAL.replace('worker = ["echo"]', "worker = 'echo'"),
            "f.toml: models[0].worker: expected an import path 'module:Name'",
        ),
        (MINIMAL.replace('["echo"]', "['echo', 1]"), "f.toml: models[0].worker[1]: expected str, got 1"),
        (
            MINIMAL + "policy_options = { max_batch = true }\n",
            "f.toml: models[0].policy_options[...]: expected float, got {'max_batch': True}",
        ),
        (MINIMAL + "aliases = 'm'\n", "f.toml: models[0].aliases: expected a list, got 'm'"),
        ("[server]\nport = 80.0\n" + MINIMAL, "f.toml: server.port: expected int, got 80.0"),
        (
            MINIMAL
            + "[[keys]]\nkey = 'sk-000000001'\ntenant = 't'\ntier = 'paid'\ntokens_per_minute = '9'\n",
            "f.toml: keys[0].tokens_per_minute: expected int | null, got '9'",
        ),
        (
            MINIMAL.replace('worker = ["echo"]', "mode = 'continuous'\nsimulated = 'llama-70b'\nthreads = 0"),
            "f.toml: models[0].threads: expected 1..1024, got 0",
        ),
        (
            MINIMAL.replace('worker = ["echo"]', "mode='continuous'\nsimulated='llama-70b'\nmax_step_ms=0"),
            "f.toml: models[0].max_step_ms: expected milliseconds > 0, got 0",
        ),
        (
            MINIMAL.replace('worker = ["echo"]', "mode='continuous'\nsimulated='llama-70b'\nmax_step_ms=inf"),
            "f.toml: models[0].max_step_ms: expected milliseconds > 0, got inf",
        ),
        (
            MINIMAL.replace('worker = ["echo"]', "mode='continuous'\nmodel='smollm2-135m'\nweights='q4'"),
            "f.toml: models[0].weights: expected one of ['bf16', 'int8', 'int4'], got 'q4'",
        ),
        (
            MINIMAL.replace('worker = ["echo"]', "mode='continuous'\nmodel='smollm2-135m'\nweights='int8'"),
            "f.toml: models[0].weights: expected 'bf16' unless ferry's engine runs a real model in bfloat16",
        ),
        (MINIMAL.replace('name = "m@1"\n', ""), "f.toml: models[0]: missing field 'name'"),
        (
            MINIMAL + "[[models]]\nname = 'n@1'\naliases = ['m@1']\nworker = ['echo']\n",
            "f.toml: models[1]: 'm@1' already names model 'm@1'",
        ),
        (
            MINIMAL + "[[keys]]\nkey = 'sk-000000001'\ntenant = 't'\ntier = 'gold'\n",
            "f.toml: keys[0].tier: expected one of ['paid'], got 'gold'",
        ),
        (MINIMAL + "[[keys]]\ntenant = 't'\ntier = 'paid'\n", "f.toml: keys[0].key: expected exactly one of"),
        (
            MINIMAL + "[[keys]]\nkey = 'short'\ntenant = 't'\ntier = 'paid'\n",
            "f.toml: keys[0].key: expected at least 8",
        ),
        (
            MINIMAL + "[[keys]]\nkey_sha256 = 'ABC'\ntenant = 't'\ntier = 'paid'\n",
            "f.toml: keys[0].key_sha256: expected 64 lowercase hex digits",
        ),
        (
            MINIMAL + "[[keys]]\nkey = 'sk-000000001'\ntenant = 't'\ntier = 'paid'\n"
            "[[keys]]\nkey = 'sk-000000001'\ntenant = 'u'\ntier = 'paid'\n",
            "f.toml: keys: expected distinct keys",
        ),
        (
            MINIMAL + "[[keys]]\nkey = 'sk-000000001'\ntenant = 't'\ntier = 'paid'\nweight = 0\n",
            "f.toml: keys[0].weight: expected a weight in (0, 1000.0], got 0",
        ),
        (
            MINIMAL + "[[keys]]\nkey = 'sk-000000001'\ntenant = 't'\ntier = 'paid'\nweight = 2\n"
            "[[keys]]\nkey = 'sk-000000002'\ntenant = 't'\ntier = 'paid'\n",
            "f.toml: keys[1].weight: expected the weight of tenant 't''s other keys (2",
        ),
        (
            "[aliases]\nm = 1\n" + MINIMAL,
            "f.toml: aliases.m: expected a table of model versions to weights, got 1",
        ),
        ("[aliases]\nm = {}\n" + MINIMAL, "f.toml: aliases.m: expected a table of model versions to weights"),
        (
            "[aliases]\nm = { 'm@2' = 1 }\n" + MINIMAL,
            "f.toml: aliases.m: expected model versions, one of ['m@1'], got 'm@2'",
        ),
        (
            "[aliases]\nm = { 'm@1' = -1 }\n" + MINIMAL,
            "f.toml: aliases.m.m@1: expected a weight >= 0, got -1",
        ),
        (
            "[aliases]\nm = { 'm@1' = 0 }\n" + MINIMAL,
            "f.toml: aliases.m: expected weights adding up to more than 0",
        ),
        (
            "[aliases]\nm = { 'm@1' = true }\n" + MINIMAL,
            "f.toml: aliases.m.m@1: expected a weight >= 0, got True",
        ),
        (
            "[aliases]\n'm@1' = { 'm@1' = 1 }\n" + MINIMAL,
            "f.toml: aliases.m@1: expected a name no model uses",
        ),
        (
            "[admin]\ntoken_sha256 = 'x'\n" + MINIMAL,
            "f.toml: admin.token_sha256: expected 64 lowercase hex digits",
        ),
        ("[admin]\ntoken = 'x'\n" + MINIMAL, "f.toml: admin: unknown field 'token'"),
        (
            MINIMAL.replace('["echo"]', "'my_pkg.embed'"),
            "f.toml: models[0].worker: expected an import path 'module:Name'",
        ),
        (
            MINIMAL + "pythonpath = ['src']\n",
            "f.toml: models[0].worker: expected an import path 'module:Name' where pythonpath or",
        ),
        (
            MINIMAL.replace('["echo"]', "'m:M'") + "pythonpath = ['no-such-dir']\n",
            "f.toml: models[0].pythonpath: expected directories, got '/",
        ),
        (
            MINIMAL.replace('["echo"]', "'m:M'") + "worker_options = { when = 1979-05-27 }\n",
            "f.toml: models[0].worker_options: expected a table of strings, numbers, booleans",
        ),
        (MINIMAL + "gpu_hour_price = -1\n", "f.toml: models[0].gpu_hour_price: expected a price"),
        (MINIMAL + "kind = 'image'\n", "f.toml: models[0].kind: expected one of ['text', 'embedding']"),
        (MINIMAL + "kind = 'embedding'\n", "f.toml: models[0].dimensions: expected 1..65536"),
        (MINIMAL + "dimensions = 8\n", "f.toml: models[0].dimensions: expected none for a text model"),
        (
            MINIMAL + "tokenizer = 'package:no_such_package/model'\n",
            "f.toml: models[0].tokenizer: expected 'bytes' or a path to a tokenizer.json",
        ),
    ],
)
def test_every_mistake_names_the_file_and_the_field(text, message):
    with pytest.raises(ValueError) as caught:
        parse_config(text, "f.toml")
    assert str(caught.value).startswith(message)


def test_a_model_of_ones_own_is_an_import_path_with_a_pythonpath_beside_the_file(tmp_path):
    """``pythonpath`` is relative to the configuration file, wherever ferry is started from; the
    workers get it, the target and the options on their command line (the gateway imports nothing)."""
    (tmp_path / "src").mkdir()
    path = tmp_path / "ferry.toml"
    path.write_text(MINIMAL.replace('["echo"]', '"my_pkg.embed:MiniLM"')
                    + 'pythonpath = ["src"]\nworker_options = { dim = 384, names = ["a"] }\n'
                    + 'kind = "embedding"\ndimensions = 384\n')
    model = load_config(path).models[0]
    assert model.argv == ["model", "my_pkg.embed:MiniLM", "--pythonpath", str(tmp_path / "src"),
                          "--options", json.dumps({"dim": 384, "names": ["a"]})]
    assert model.outputs == Outputs("embedding", 384, shortenable=False)
    assert parse_config(MINIMAL).models[0].argv == ["echo"]  # a built-in kind's argv, as before


def test_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        load_config(tmp_path / "absent.toml")


def test_the_configuration_reference_shows_the_example_file_as_it_is():
    reference = (EXAMPLE.parent.parent / "docs" / "configuration.md").read_text()
    assert "```toml\n" + EXAMPLE.read_text() + "```" in reference


def test_ferry_variables_set_any_field_over_the_file():
    environ = {"FERRY_SERVER__PORT": "9000", "FERRY_MODELS__0__MAX_BATCH": "32",
               "FERRY_LIMITS__STORE": "redis", "FERRY_MODELS__0__WORKER": '["sleep", "--latency-ms", "5"]',
               "FERRY_STATE__DIR": "/srv/ferry", "FERRY_ALIASES__CANARY": '{ "m@1" = 1 }', "OTHER": "ignored",
               "FERRY_ADMIN_TOKEN": "not a field"}
    config = parse_config(MINIMAL, "f.toml", environ)
    assert (config.server.port, config.models[0].max_batch, config.limits.store) == (9000, 32, "redis")
    assert config.models[0].worker == ("sleep", "--latency-ms", "5") and config.state.dir == "/srv/ferry"
    assert config.aliases[0].name == "canary"
    assert parse_config(MINIMAL, "f.toml") == parse_config(MINIMAL, "f.toml", {})  # none: the file alone


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"FERRY_SERVER__PORT": "-1"},
            "f.toml: server.port: expected 0..65535, got -1 (set by FERRY_SERVER__PORT)",
        ),
        ({"FERRY_MODELS__3__WORKERS": "2"}, "f.toml: FERRY_MODELS__3__WORKERS: models[3]: no such table"),
        ({"FERRY_TIERS__0__NAME__X": "1"}, "f.toml: FERRY_TIERS__0__NAME__X: tiers[0].name is not a table"),
    ],
)
def test_a_variable_that_sets_a_bad_value_is_named(environ, message):
    with pytest.raises(ValueError) as caught:
        parse_config(MINIMAL, "f.toml", environ)
    assert str(caught.value).startswith(message)


SEVERAL = """
[server]
port = 70000
max_body_bytes = 5
colour = "blue"
[[tiers]]
name = "paid"
wait_budget_ms = 0
[[keys]]
key = "short"
tenant = "t"
tier = "paid"
[[models]]
name = "m@1"
worker = ["echo"]
workers = 0
max_batch = 0
"""


def test_check_config_finds_every_error_of_a_file_at_once(tmp_path, capsys):
    path = tmp_path / "several.toml"
    path.write_text(SEVERAL)
    assert cli.check_config(argparse.Namespace(file=str(path))) == 1
    printed = capsys.readouterr().out.splitlines()
    where = [line.removeprefix(f"{path}: ").split(":")[0] for line in printed]
    assert where == ["server", "server.port", "server.max_body_bytes", "tiers[0].wait_budget_ms",
                     "keys[0].key", "models[0].max_batch", "models[0].workers"]
    assert all(line.startswith(f"{path}: ") for line in printed)
    with pytest.raises(ValueError, match="server: unknown field 'colour'"):  # a load stops at the first
        load_config(path)
    good = tmp_path / "good.toml"
    good.write_text(MINIMAL)
    assert cli.check_config(argparse.Namespace(file=str(good))) == 0
    assert capsys.readouterr().out == f"{good}: ok\n"
