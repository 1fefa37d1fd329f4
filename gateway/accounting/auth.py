"""API keys: which tenant and tier a request speaks for.

Keys are held only as sha256 digests, whether the config file gave the key or its digest, so a
config (or a memory dump) need not hold a usable secret; a presented key is hashed and looked
up. A key arrives in ``x-api-key`` (what the Anthropic SDK sends) or ``Authorization: Bearer``.
Per-key limits ride along on the :class:`Principal` for the ledger
(:mod:`gateway.accounting.ledger`) to charge; this module only says who is calling.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

from gateway.accounting.ratelimit import Limits
from gateway.config import KeyConfig
from gateway.wire.api import AuthenticationFailed


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """Who a request speaks for, once its key is known."""

    tenant: str
    tier: str
    key_id: str  # the digest's first 12 hex digits: names the key in logs, reveals nothing
    limits: Limits


class KeyRing:
    def __init__(self, keys: Sequence[KeyConfig]) -> None:
        self._by_digest = {
            key.digest: Principal(
                key.tenant, key.tier, key.digest[:12], Limits(key.tokens_per_minute, key.requests_per_minute)
            )
            for key in keys
        }

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The principal of a request's key; :class:`AuthenticationFailed` if none or unknown."""
        key = presented_key(headers)
        if key is None:
            raise AuthenticationFailed("no API key: send it in the x-api-key header")
        principal = self._by_digest.get(hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest())
        if principal is None:
            raise AuthenticationFailed("invalid x-api-key")
        return principal


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``x-api-key``, else a bearer token; None if neither."""
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None
