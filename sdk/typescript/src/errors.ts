// The SDK's error: every failed call throws an ExpertError. The services report bad input as
// INVALID_ARGUMENT with a google.rpc.BadRequest in grpc-status-details-bin (AIP-193); Connect parses
// that trailer, and its field violations become `fieldViolations`. A key over its limits gets a
// google.rpc.RetryInfo: `retryAfterMs`.
import { Code, ConnectError } from "@connectrpc/connect";
import { BadRequestSchema, RetryInfoSchema } from "./gen/google/rpc/error_details_pb.js";

export interface FieldViolation {
  /** The request field, as the services name it (e.g. "request.temperature"). */
  field: string;
  description: string;
}

/** gRPC status names, as the Python SDK and the services' logs spell them. */
export type StatusName =
  | "CANCELLED" | "UNKNOWN" | "INVALID_ARGUMENT" | "DEADLINE_EXCEEDED" | "NOT_FOUND"
  | "ALREADY_EXISTS" | "PERMISSION_DENIED" | "RESOURCE_EXHAUSTED" | "FAILED_PRECONDITION"
  | "ABORTED" | "OUT_OF_RANGE" | "UNIMPLEMENTED" | "INTERNAL" | "UNAVAILABLE" | "DATA_LOSS"
  | "UNAUTHENTICATED";

const STATUS_NAMES: Record<Code, StatusName> = {
  [Code.Canceled]: "CANCELLED",
  [Code.Unknown]: "UNKNOWN",
  [Code.InvalidArgument]: "INVALID_ARGUMENT",
  [Code.DeadlineExceeded]: "DEADLINE_EXCEEDED",
  [Code.NotFound]: "NOT_FOUND",
  [Code.AlreadyExists]: "ALREADY_EXISTS",
  [Code.PermissionDenied]: "PERMISSION_DENIED",
  [Code.ResourceExhausted]: "RESOURCE_EXHAUSTED",
  [Code.FailedPrecondition]: "FAILED_PRECONDITION",
  [Code.Aborted]: "ABORTED",
  [Code.OutOfRange]: "OUT_OF_RANGE",
  [Code.Unimplemented]: "UNIMPLEMENTED",
  [Code.Internal]: "INTERNAL",
  [Code.Unavailable]: "UNAVAILABLE",
  [Code.DataLoss]: "DATA_LOSS",
  [Code.Unauthenticated]: "UNAUTHENTICATED",
};

export class ExpertError extends Error {
  /** The gRPC status name, e.g. "INVALID_ARGUMENT". */
  readonly code: StatusName;
  /** The field violations of a google.rpc.BadRequest detail; empty without one. */
  readonly fieldViolations: FieldViolation[];
  /** How long a google.rpc.RetryInfo detail asks to wait before retrying; undefined without one. */
  readonly retryAfterMs: number | undefined;

  constructor(code: StatusName, message: string, fieldViolations: FieldViolation[] = [], retryAfterMs?: number) {
    super(message ? `${code}: ${message}` : code);
    this.name = "ExpertError";
    this.code = code;
    this.fieldViolations = fieldViolations;
    this.retryAfterMs = retryAfterMs;
  }

  /** The ExpertError for anything a Connect call threw (an AbortError or a network error included). */
  static from(error: unknown): ExpertError {
    if (error instanceof ExpertError) return error;
    const connectError = ConnectError.from(error);
    const tls = tlsFailure(connectError);
    if (tls) return new ExpertError("UNAVAILABLE", `TLS handshake failed (${tls}): ${connectError.rawMessage}`);
    const violations = connectError
      .findDetails(BadRequestSchema)
      .flatMap((detail) => detail.fieldViolations.map(({ field, description }) => ({ field, description })));
    const retry = connectError.findDetails(RetryInfoSchema)[0]?.retryDelay;
    const retryAfterMs = retry ? Number(retry.seconds) * 1000 + retry.nanos / 1e6 : undefined;
    return new ExpertError(STATUS_NAMES[connectError.code], connectError.rawMessage, violations, retryAfterMs);
  }
}

// Node's error codes for a TLS handshake this side refused: OpenSSL's verdicts on the server's
// certificate (UNABLE_TO_VERIFY_LEAF_SIGNATURE, SELF_SIGNED_CERT_IN_CHAIN, CERT_HAS_EXPIRED, ...) and
// node's own (ERR_TLS_CERT_ALTNAME_INVALID: not for this name). Connect reports them as INTERNAL;
// they are UNAVAILABLE, as gRPC's other clients (the Python SDK) report a failed handshake.
const TLS_FAILURE = /^(ERR_TLS_|ERR_SSL_)|CERT|^UNABLE_TO_|SELF_SIGNED|HOSTNAME_MISMATCH/;

function tlsFailure(error: ConnectError): string | undefined {
  const code = (error.cause as { code?: unknown } | undefined)?.code;
  return typeof code === "string" && TLS_FAILURE.test(code) ? code : undefined;
}

/** `await call()`, with its failure thrown as an ExpertError. */
export async function wrapCall<T>(call: () => Promise<T>): Promise<T> {
  try {
    return await call();
  } catch (error) {
    throw ExpertError.from(error);
  }
}
