"""``ferry --version``: the installed distribution's version, answered without importing the core."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from gateway import cli


def test_ferry_version_prints_the_installed_version_without_loading_the_core(capsys):
    loaded = set(sys.modules)
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"ferry {importlib.metadata.version('trio-ferry')}\n"
    assert not {"gateway.http.server", "batcher.sim.fixed.simulate"} & (set(sys.modules) - loaded)
