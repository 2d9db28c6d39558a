// Where the client connects and with what: the reception's address, the API key sent with every
// call (a Connect interceptor), and the HTTP/2 session the client owns so that close() can end it.
import type { Interceptor, Transport } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import type * as http2 from "node:http2";

export const DEFAULT_TARGET = "127.0.0.1:50051";
export const TARGET_ENV = "EXPERT_RECEPTION_TARGET";
export const API_KEY_ENV = "EXPERT_API_KEY";
// The quick calls' deadline (submit, getJob, cancel, sessions, keys), as the Python SDK's. infer and
// the streams have none by default: a job has its own timeoutMs, after which the server returns the
// partial output.
export const DEFAULT_TIMEOUT_MS = 10_000;

export interface ConnectionOptions {
  /** host:port of the reception's gRPC port; default $EXPERT_RECEPTION_TARGET, else 127.0.0.1:50051. */
  target?: string;
  /** Sent as `authorization: Bearer <apiKey>`; default $EXPERT_API_KEY; none: no header (EXPERT_AUTH=off). */
  apiKey?: string;
  /** TLS: the CA, and a client certificate and key for mutual TLS. Without it the channel is plain h2c. */
  tls?: Pick<http2.SecureClientSessionOptions, "ca" | "cert" | "key" | "servername">;
  /** Deadline of the quick calls, in ms (default 10 000). */
  defaultTimeoutMs?: number;
  /** More Connect interceptors, run after the one that adds the API key. */
  interceptors?: Interceptor[];
}

export interface Connection {
  transport: Transport;
  session: Http2SessionManager;
}

export function resolveTarget(target?: string): string {
  return target || process.env[TARGET_ENV] || DEFAULT_TARGET;
}

/** The interceptor that sends the API key on every call (unary and streaming alike). */
export function bearerInterceptor(apiKey: string): Interceptor {
  return (next) => async (request) => {
    request.header.set("authorization", `Bearer ${apiKey}`);
    return next(request);
  };
}

export function connect(options: ConnectionOptions): Connection {
  const baseUrl = `${options.tls ? "https" : "http"}://${resolveTarget(options.target)}`;
  const session = new Http2SessionManager(baseUrl, {}, options.tls ?? {});
  const apiKey = options.apiKey || process.env[API_KEY_ENV];
  const interceptors = [...(apiKey ? [bearerInterceptor(apiKey)] : []), ...(options.interceptors ?? [])];
  const transport = createGrpcTransport({
    baseUrl,
    sessionManager: session,
    interceptors,
    // The services accept messages up to 64 MiB (a long prompt, a large body).
    readMaxBytes: 64 * 1024 * 1024,
    writeMaxBytes: 64 * 1024 * 1024,
  });
  return { transport, session };
}
