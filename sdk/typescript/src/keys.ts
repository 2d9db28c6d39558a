// API keys (docs/api.md#authentication): create, list and revoke. Every call needs an admin key
// (or the operator's internal token).
import type { CallOptions, Client } from "@connectrpc/connect";
import { KeyScope, KeyService, type ApiKey } from "./gen/expert/v1/keys_pb.js";
import { wrapCall } from "./errors.js";
import { optionalBigInt } from "./request.js";

export interface CreateKeyOptions {
  /** A name for people (1-64 characters). */
  name: string;
  /** "infer" (the default), "train" or "admin". */
  scope?: "infer" | "train" | "admin";
  /** Requests per minute; 0 or left out: no limit. */
  rateLimit?: number;
  /** Generated tokens per minute; 0 or left out: no limit. */
  tokenLimit?: number;
}

export interface CreatedKey {
  key: ApiKey;
  /** The key to send as the client's apiKey: shown this once, never stored. */
  secret: string;
}

const SCOPES = { infer: KeyScope.INFER, train: KeyScope.TRAIN, admin: KeyScope.ADMIN } as const;

export class Keys {
  constructor(
    private readonly stub: Client<typeof KeyService>,
    private readonly callOptions: () => CallOptions,
  ) {}

  async create(options: CreateKeyOptions): Promise<CreatedKey> {
    const request = {
      name: options.name,
      scope: SCOPES[options.scope ?? "infer"],
      rateLimit: optionalBigInt(options.rateLimit ?? 0, "rate_limit"),
      tokenLimit: optionalBigInt(options.tokenLimit ?? 0, "token_limit"),
    };
    const response = await wrapCall(() => this.stub.createKey(request, this.callOptions()));
    return { key: response.key!, secret: response.secret };
  }

  /** Every key, revoked ones included (never the secrets). */
  async list(): Promise<ApiKey[]> {
    return (await wrapCall(() => this.stub.listKeys({}, this.callOptions()))).keys;
  }

  /** Revoke a key: it is refused from the next call on. Returns it as revoked. */
  async revoke(keyId: string): Promise<ApiKey> {
    return (await wrapCall(() => this.stub.revokeKey({ keyId }, this.callOptions()))).key!;
  }
}
