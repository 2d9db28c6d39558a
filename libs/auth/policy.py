"""Who may call what: each method's access, the caller a credential proves, and the refusals.

Every RPC is one of:
- PUBLIC: anyone (grpc.health, reflection);
- INFER: an API key of any scope;
- TRAIN: an API key of scope train or admin (training files and training jobs);
- ADMIN: an API key of scope admin (registering experts, managing keys);
- INTERNAL: only the internal token (the services' calls to each other).
The internal token allows everything. A service without a key store (no Redis: the engine,
preparation) can only accept the internal token. With EXPERT_AUTH=off nothing is checked.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from libs.auth.config import AuthConfig
from libs.auth.keys import ADMIN, TRAIN, KeyStore
from libs.errors import permission_denied, unauthenticated


class Access(enum.Enum):
    PUBLIC = "public"
    INFER = "infer"
    TRAIN = "train"
    ADMIN = "admin"
    INTERNAL = "internal"


# The key scopes each level above INFER admits (INFER admits every key).
_SCOPES_ALLOWED = {Access.TRAIN: (TRAIN, ADMIN), Access.ADMIN: (ADMIN,)}

# Health checks and reflection: probes and tools must reach them without credentials.
PUBLIC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def methods(service: str, access: Mapping[str, Access]) -> dict[str, Access]:
    """`access` (method name -> Access) of `service` ("expert.v1.RouterService") keyed by the full
    method names gRPC calls them by ("/expert.v1.RouterService/Plan")."""
    return {f"/{service}/{name}": level for name, level in access.items()}


@dataclass(frozen=True)
class Caller:
    """Who is calling: a service with the internal token (key_id None), or an API key."""

    key_id: str | None
    scope: str  # "internal", "admin", "train" or "infer"
    rate_limit: int = 0  # requests per minute; 0: no limit
    token_limit: int = 0  # generated tokens per minute; 0: no limit


INTERNAL_CALLER = Caller(key_id=None, scope="internal")

_caller: ContextVar[Caller | None] = ContextVar("expert_caller", default=None)


def current_caller() -> Caller | None:
    """The caller of the call being served (None with auth off, or on a public method)."""
    return _caller.get()


@contextlib.contextmanager
def calling_as(caller: Caller | None) -> Iterator[None]:
    """Makes `caller` the current caller inside the block (the gRPC interceptor, the HTTP front)."""
    token = _caller.set(caller)
    try:
        yield
    finally:
        # ValueError: an async generator finalized in another context; that context is gone.
        with contextlib.suppress(ValueError):
            _caller.reset(token)


def serving_as(caller: Caller | None) -> None:
    """Makes `caller` the current caller for the rest of the current task: the HTTP front, where
    the server runs each request in its own task (whose context dies with it)."""
    _caller.set(caller)


class Authenticator:
    """Decides a call from its credentials: `authenticate` returns the caller or raises the
    refusal (UNAUTHENTICATED, PERMISSION_DENIED). `access` is the service's declaration of its
    methods; a method it does not declare is INTERNAL (closed unless declared open)."""

    def __init__(
        self, config: AuthConfig, access: Mapping[str, Access], keys: KeyStore | None = None
    ) -> None:
        self.config = config
        self.access = dict(access)
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return self.config.required

    def access_of(self, method: str) -> Access:
        if method.startswith(PUBLIC_PREFIXES):
            return Access.PUBLIC
        return self.access.get(method, Access.INTERNAL)

    async def authenticate(
        self, access: Access, bearer: str | None, internal_token: str | None
    ) -> Caller | None:
        """The caller allowed to make a call of `access` with `bearer` (the API key of an
        `authorization: Bearer` header) or `internal_token`; None when nothing is checked."""
        if not self.enabled or access is Access.PUBLIC:
            return None
        if internal_token is not None:
            if not hmac.compare_digest(internal_token.encode(), self.config.internal_token.encode()):
                raise unauthenticated("wrong internal token")
            return INTERNAL_CALLER
        if access is Access.INTERNAL:
            if bearer is not None and await self._verify(bearer) is not None:
                raise permission_denied("this method is internal: only the services may call it")
            raise unauthenticated("this method is internal: it needs the internal token")
        if bearer is None:
            raise unauthenticated("missing API key: send it as `authorization: Bearer <key>`")
        if self.keys is None:
            raise unauthenticated("this service accepts only the internal token, not API keys")
        caller = await self._verify(bearer)
        if caller is None:
            raise unauthenticated("invalid or revoked API key")
        allowed = _SCOPES_ALLOWED.get(access)
        if allowed is not None and caller.scope not in allowed:
            raise permission_denied(
                f"API key {caller.key_id} has scope {caller.scope}; this method needs {access.value}"
            )
        return caller

    async def _verify(self, bearer: str) -> Caller | None:
        """The caller `bearer` proves, None for a wrong or revoked key (or without a key store)."""
        if self.keys is None:
            return None
        record = await self.keys.verify(bearer)
        if record is None or record.revoked:
            return None
        return Caller(record.key_id, record.scope, record.rate_limit, record.token_limit)


def bearer_token(authorization: str | None) -> str | None:
    """The credential of an `authorization: Bearer <token>` value; None when absent or another scheme."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
