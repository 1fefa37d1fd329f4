"""A gateway's usage records as its operator reads them (``usage.sqlite`` in its state directory),
once its writer thread has written them."""

from __future__ import annotations

from gateway.accounting.usage import read_usage
from tests.support.gateway_process import Gateway
from tests.support.waiting import until


def records(gateway: Gateway, ids: set[str], within: float = 10.0) -> dict:
    """The usage records of these request ids, by id, once every one is written."""
    path = gateway.tmp / "usage.sqlite"

    def written() -> dict | None:
        if not path.exists():
            return None
        found = {r.request_id: r for r in read_usage(str(path)) if r.request_id in ids}
        return found if len(found) == len(ids) else None

    return until(written, f"the usage records of {len(ids)} requests", within=within, every=0.05)
