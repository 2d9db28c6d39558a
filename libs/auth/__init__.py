"""API keys, scopes and the internal token (docs/api.md#authentication).

- `config`: EXPERT_AUTH and EXPERT_INTERNAL_TOKEN, read in one place for every service;
- `keys`: the API keys, stored in Redis as SHA-256 hashes (never in clear);
- `policy`: who may call what (public, infer, admin, internal), and the caller of the current call;
- `interceptor`: the gRPC server interceptor that enforces the policy;
- `metadata`: the credentials as call metadata, and the client interceptors that send the
  internal token on every service-to-service channel;
- `limits`: the per-key requests and generated tokens per minute, one atomic Redis script.
"""
