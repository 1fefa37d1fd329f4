"""The placement fields of a model table and the ``[ray]`` table, and which nodes can take a
worker: pure, no cluster needed."""

from __future__ import annotations

import pytest

from batcher.placement.ray_actors import Ask, fitting_nodes
from gateway.config import parse_config
from tests.support.minimal_config import MINIMAL

RAY_MODEL = (
    MINIMAL
    + 'placement = "ray"\nnum_gpus = 0.5\naccelerator_type = "H100"\n'
    + "resources = { nvlink = 1 }\n"
)


def test_a_ray_placed_model_and_the_ray_table_load_with_every_field():
    config = parse_config('[ray]\naddress = "10.0.0.1:6379"\nnamespace = "prod"\n' + RAY_MODEL)
    (model,) = config.models
    assert (config.ray.address, config.ray.namespace) == ("10.0.0.1:6379", "prod")
    assert (model.placement, model.num_gpus, model.accelerator_type, model.resources) == ("ray", 0.5, "H100",
                                                                                        {"nvlink": 1})


def test_models_are_local_by_default_and_ray_joins_the_cluster_this_machine_is_in():
    config = parse_config(MINIMAL)
    (model,) = config.models
    placement = (model.placement, model.num_gpus, model.resources, model.accelerator_type)
    assert placement == ("local", None, {}, "")
    assert (config.ray.address, config.ray.namespace) == ("auto", "ferry")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (MINIMAL + 'placement = "k8s"\n',
         "f.toml: models[0].placement: expected one of ['local', 'ray'], got 'k8s'"),
        (MINIMAL + "num_gpus = -1\n", "f.toml: models[0].num_gpus: expected 0..1024, got -1"),
        (MINIMAL + "resources = { nvlink = -1 }\n", "f.toml: models[0].resources: expected amounts >= 0"),
        (MINIMAL + "resources = { nvlink = 'x' }\n",
         "f.toml: models[0].resources[...]: expected float"),
        ('[ray]\naddress = "head"\n' + MINIMAL,
         "f.toml: ray.address: expected 'auto', 'local' or host:port, got 'head'"),
        ('[ray]\naddress = "head:0"\n' + MINIMAL,
         "f.toml: ray.address: expected 'auto', 'local' or host:port"),
        ('[ray]\nnamespace = ""\n' + MINIMAL, "f.toml: ray.namespace: expected a namespace name"),
        ('[ray]\nport = 1\n' + MINIMAL, "f.toml: ray: unknown field 'port'"),
    ],
)
def test_every_placement_mistake_names_the_file_and_the_field(text, message):
    with pytest.raises(ValueError) as caught:
        parse_config(text, "f.toml")
    assert str(caught.value).startswith(message)


NODES = [
    {"NodeID": "cpu", "Alive": True, "Resources": {"CPU": 16.0}},
    {"NodeID": "h100", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
    {"NodeID": "gone", "Alive": False,
     "Resources": {"GPU": 8.0, "accelerator_type:H100": 1.0, "nvlink": 1.0}},
    {"NodeID": "a10", "Alive": True, "Resources": {"GPU": 1.0, "accelerator_type:A10G": 1.0}},
]


@pytest.mark.parametrize(
    ("ask", "nodes"),
    [
        (Ask(0, {}, ""), ["cpu", "h100", "a10"]),
        (Ask(1, {}, ""), ["h100", "a10"]),
        (Ask(2, {}, ""), ["h100"]),
        (Ask(1, {}, "A10G"), ["a10"]),
        (Ask(1, {"nvlink": 1}, ""), []),  # only a dead node has it
        (Ask(16, {}, ""), []),
    ],
)
def test_a_worker_fits_the_live_nodes_that_hold_all_it_asks_for(ask, nodes):
    assert fitting_nodes(NODES, ask) == nodes
