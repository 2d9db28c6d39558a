"""KeyService: creating, listing and revoking API keys (docs/api.md#authentication).

Every RPC needs an admin key or the internal token in every mode, EXPERT_AUTH=off included
(libs.auth.policy's KEYS level): keys may be made before auth is turned on, but only by whoever
could make them after, so no key minted without credentials exists.
"""

from __future__ import annotations

import re

import grpc

from libs.auth.keys import ADMIN, INFER, TRAIN, KeyRecord, KeyStore
from libs.auth.policy import Access, methods
from libs.errors import invalid_argument, invalid_arguments, not_found
from libs.gen.expert.v1 import keys_pb2, keys_pb2_grpc
from libs.logging import get_logger
from libs.timestamps import timestamp
from services.reception.tolerant import add_refusing_service

log = get_logger(__name__)

SERVICE = "expert.v1.KeyService"
_METHODS = ("CreateKey", "ListKeys", "RevokeKey")
ACCESS = methods(SERVICE, dict.fromkeys(_METHODS, Access.KEYS))
MAX_NAME_CHARS = 64
# A limit above this is no limit anyone means (and would not fit the limiter's arithmetic).
MAX_LIMIT = 1_000_000_000
_KEY_ID = re.compile(r"^[0-9a-f]{12}$")
_SCOPES = {
    keys_pb2.KEY_SCOPE_UNSPECIFIED: INFER,
    keys_pb2.KEY_SCOPE_INFER: INFER,
    keys_pb2.KEY_SCOPE_ADMIN: ADMIN,
    keys_pb2.KEY_SCOPE_TRAIN: TRAIN,
}
_SCOPE_ENUMS = {_SCOPES[enum]: enum for enum in _SCOPES if enum != keys_pb2.KEY_SCOPE_UNSPECIFIED}


def key_proto(record: KeyRecord) -> keys_pb2.ApiKey:
    key = keys_pb2.ApiKey(
        key_id=record.key_id,
        name=record.name,
        scope=_SCOPE_ENUMS[record.scope],
        rate_limit=record.rate_limit,
        token_limit=record.token_limit,
        created_at=timestamp(record.created_at),
    )
    if record.revoked_at is not None:
        key.revoked_at.CopyFrom(timestamp(record.revoked_at))
    return key


class KeyServicer(keys_pb2_grpc.KeyServiceServicer):
    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    async def CreateKey(
        self, request: keys_pb2.CreateKeyRequest, context: grpc.aio.ServicerContext
    ) -> keys_pb2.CreateKeyResponse:
        problems = []
        name = request.name.strip()
        if not name:
            problems.append(("name", "must not be empty"))
        elif len(name) > MAX_NAME_CHARS:
            problems.append(("name", f"at most {MAX_NAME_CHARS} characters, got {len(name)}"))
        if request.scope not in _SCOPES:
            problems.append(("scope", f"unknown scope {request.scope}"))
        for field in ("rate_limit", "token_limit"):
            value = getattr(request, field)
            if not 0 <= value <= MAX_LIMIT:
                problems.append((field, f"must be in [0, {MAX_LIMIT}] (0: no limit), got {value}"))
        if problems:
            raise invalid_arguments(problems)
        record, secret = await self.keys.create(
            name, _SCOPES[request.scope], request.rate_limit, request.token_limit
        )
        log.info("API key created", key_id=record.key_id, name=name, scope=record.scope)
        return keys_pb2.CreateKeyResponse(key=key_proto(record), secret=secret)

    async def ListKeys(
        self, request: keys_pb2.ListKeysRequest, context: grpc.aio.ServicerContext
    ) -> keys_pb2.ListKeysResponse:
        return keys_pb2.ListKeysResponse(keys=[key_proto(record) for record in await self.keys.list()])

    async def RevokeKey(
        self, request: keys_pb2.RevokeKeyRequest, context: grpc.aio.ServicerContext
    ) -> keys_pb2.RevokeKeyResponse:
        if not _KEY_ID.match(request.key_id):
            raise invalid_argument("key_id", f"expected 12 hex digits, got {request.key_id[:64]!r}")
        record = await self.keys.revoke(request.key_id)
        if record is None:
            raise not_found(f"no API key {request.key_id}")
        log.info("API key revoked", key_id=record.key_id)
        return keys_pb2.RevokeKeyResponse(key=key_proto(record))


def add_to_server(servicer: KeyServicer, server: grpc.aio.Server) -> str:
    """Register the servicer (bad UTF-8 is INVALID_ARGUMENT: tolerant.py)."""
    return add_refusing_service(server, SERVICE, servicer, _METHODS, keys_pb2)
