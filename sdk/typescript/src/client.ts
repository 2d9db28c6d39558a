// ExpertClient: the reception's public gRPC API (InferenceService, SessionService, KeyService) over
// Connect's gRPC transport for Node.
import { createClient, type CallOptions, type Client } from "@connectrpc/connect";
import type { Job, JobSubmission, InferenceResult } from "./gen/expert/v1/common_pb.js";
import { InferenceService } from "./gen/expert/v1/inference_pb.js";
import { KeyService } from "./gen/expert/v1/keys_pb.js";
import { SessionService } from "./gen/expert/v1/session_pb.js";
import { connect, DEFAULT_TIMEOUT_MS, type Connection, type ConnectionOptions } from "./connection.js";
import { ExpertError, wrapCall } from "./errors.js";
import { Keys } from "./keys.js";
import { buildRequest, type InferOptions } from "./request.js";
import { Session, sessionRequest, type SessionOptions } from "./session.js";
import { InferStream } from "./stream.js";

/**
 * A connection to the reception. Each call takes the request's options, then Connect's call
 * options: `{ timeoutMs, signal }` (the call's deadline, and an AbortSignal). A failed call throws
 * an ExpertError. Call close() when done.
 */
export class ExpertClient {
  readonly keys: Keys;
  private readonly connection: Connection;
  private readonly inference: Client<typeof InferenceService>;
  private readonly sessions: Client<typeof SessionService>;
  private readonly defaultTimeoutMs: number;

  constructor(options: ConnectionOptions = {}) {
    this.connection = connect(options);
    this.defaultTimeoutMs = options.defaultTimeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.inference = createClient(InferenceService, this.connection.transport);
    this.sessions = createClient(SessionService, this.connection.transport);
    this.keys = new Keys(createClient(KeyService, this.connection.transport), () => this.quick({}));
  }

  /** Run a job and wait for its result (no deadline by default: the job's own timeoutMs bounds it). */
  async infer(options: InferOptions, call: CallOptions = {}): Promise<InferenceResult> {
    const response = await wrapCall(() => this.inference.infer({ request: buildRequest(options) }, call));
    if (!response.result) throw new ExpertError("INTERNAL", "Infer answered without a result");
    return response.result;
  }

  /** Run a job and stream its text: `for await (const chunk of stream)`, then `stream.result`. */
  inferStream(options: InferOptions, call: CallOptions = {}): InferStream {
    const request = { request: buildRequest(options) };
    return new InferStream(() => this.inference.inferStream(request, call));
  }

  /** Queue a job and return at once; follow it with getJob(). */
  async submit(options: InferOptions, call: CallOptions = {}): Promise<JobSubmission> {
    const response = await wrapCall(() => this.inference.submit({ request: buildRequest(options) }, this.quick(call)));
    return response.submission!;
  }

  /** A job's status, its text so far, and its result once final. */
  async getJob(jobId: string, call: CallOptions = {}): Promise<Job> {
    return (await wrapCall(() => this.inference.getJob({ jobId }, this.quick(call)))).job!;
  }

  /** Stop a job (its engine request is aborted); returns its record after the cancellation. */
  async cancel(jobId: string, call: CallOptions = {}): Promise<Job> {
    return (await wrapCall(() => this.inference.cancelJob({ jobId }, this.quick(call)))).job!;
  }

  /** Open a multi-turn session; close() it when done. */
  async createSession(options: SessionOptions = {}, call: CallOptions = {}): Promise<Session> {
    const response = await wrapCall(() => this.sessions.createSession(sessionRequest(options), this.quick(call)));
    return new Session(this.sessions, response.session!, () => this.quick({}));
  }

  /** End the HTTP/2 connection; calls after this fail. */
  close(): void {
    this.connection.session.abort();
  }

  /** The call options with the quick calls' deadline unless the caller gave one. */
  private quick(call: CallOptions): CallOptions {
    return { timeoutMs: this.defaultTimeoutMs, ...call };
  }
}
