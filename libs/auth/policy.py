"""Who may call what: each method's access, the caller a credential proves, and the refusals.

Every RPC is one of:
- PUBLIC: anyone (grpc.health, reflection);
- INFER: an API key of any scope;
- TRAIN: an API key of scope train or admin (training files and training jobs);
- ADMIN: an API key of scope admin (registering experts);
- KEYS: an API key of scope admin, checked in every mode, EXPERT_AUTH=off included (managing keys:
  a key minted without credentials while auth is off would still work once auth is on);
- INTERNAL: only the internal token (the services' calls to each other).
The internal token allows everything. A service without a key store (no Redis: the engine,
preparation) can only accept the internal token. With EXPERT_AUTH=off nothing but KEYS is checked.

Things a key makes (sessions, stored responses) belong to it: `owning_key` names the key that owns
what a call makes, `may_reach` says whether a call may reach a thing that key owns.
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
    KEYS = "keys"
    INTERNAL = "internal"


# The key scopes each level above INFER admits (INFER admits every key).
_SCOPES_ALLOWED = {Access.TRAIN: (TRAIN, ADMIN), Access.ADMIN: (ADMIN,), Access.KEYS: (ADMIN,)}
# What a refusal says each level needs, where that is not the level's name.
_NEEDS = {Access.KEYS: "an admin key or the internal token, with EXPERT_AUTH=off too"}
# The levels checked with EXPERT_AUTH=off too.
CHECKED_WHEN_OFF = frozenset({Access.KEYS})

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
NO_OWNER = ""  # the owner of what a call without an API key makes (auth off, the internal token)


def owning_key(caller: Caller | None) -> str:
    """The API key that owns what `caller` makes (a session, a stored response): the id of the key
    it proved; NO_OWNER for a call without one (auth off, or the internal token)."""
    return caller.key_id if caller is not None and caller.key_id is not None else NO_OWNER


def may_reach(caller: Caller | None, owner: str) -> bool:
    """Whether `caller` may reach a thing `owner` owns: with auth off (no caller) everyone reaches
    everything, the internal token too; an API key only what it made. A thing without an owner
    (made with auth off, by the internal token, or before things had owners) is no key's."""
    return caller is None or caller.key_id is None or caller.key_id == owner


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
        """Whether it checks any call: every one with auth required, else those of the levels
        checked with auth off too (CHECKED_WHEN_OFF), if the service has any."""
        return self.config.required or any(level in CHECKED_WHEN_OFF for level in self.access.values())

    def checks(self, access: Access) -> bool:
        """Whether a call of `access` is checked in this mode."""
        return access is not Access.PUBLIC and (self.config.required or access in CHECKED_WHEN_OFF)

    def access_of(self, method: str) -> Access:
        if method.startswith(PUBLIC_PREFIXES):
            return Access.PUBLIC
        return self.access.get(method, Access.INTERNAL)

    async def authenticate(
        self, access: Access, bearer: str | None, internal_token: str | None
    ) -> Caller | None:
        """The caller allowed to make a call of `access` with `bearer` (the API key of an
        `authorization: Bearer` header) or `internal_token`; None when nothing is checked."""
        if not self.checks(access):
            return None
        if internal_token is not None:
            return self._internal(internal_token)
        if access is Access.INTERNAL:
            if bearer is not None and await self._verify(bearer) is not None:
                raise permission_denied("this method is internal: only the services may call it")
            raise unauthenticated("this method is internal: it needs the internal token")
        if bearer is None:
            raise unauthenticated(
                f"missing API key: this method needs {_NEEDS.get(access, 'an API key')}; send the key as "
                "`authorization: Bearer <key>`"
            )
        if self.keys is None:
            raise unauthenticated("this service accepts only the internal token, not API keys")
        caller = await self._verify(bearer)
        if caller is None:
            raise unauthenticated("invalid or revoked API key")
        allowed = _SCOPES_ALLOWED.get(access)
        if allowed is not None and caller.scope not in allowed:
            raise permission_denied(
                f"API key {caller.key_id} has scope {caller.scope}; this method needs "
                f"{_NEEDS.get(access, access.value)}"
            )
        return caller

    def _internal(self, token: str) -> Caller:
        """The services' caller, if `token` is the internal token. A service given none (auth off
        without EXPERT_INTERNAL_TOKEN) has no token to match: an empty one must not pass."""
        expected = self.config.internal_token
        if not expected:
            raise unauthenticated(
                "this service has no internal token (EXPERT_INTERNAL_TOKEN is unset): start it with one "
                "to use it, e.g. to make the first admin key"
            )
        if not hmac.compare_digest(token.encode(), expected.encode()):
            raise unauthenticated("wrong internal token")
        return INTERNAL_CALLER

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
