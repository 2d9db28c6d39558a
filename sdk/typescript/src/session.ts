// Sessions: a conversation whose KV stays on one engine between turns (docs/api.md#sessions). Each
// turn sends only what is new: append() a user message, then generate() the reply; turn() does both.
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import type { CallOptions, Client } from "@connectrpc/connect";
import {
  SessionSamplingSchema,
  SessionService,
  type Session as SessionInfo,
  type SessionSampling,
  type TurnEnd,
  type GenerateStreamResponse,
} from "./gen/expert/v1/session_pb.js";
import { ExpertError, wrapCall } from "./errors.js";
import { buildResponseFormat, optionalBigInt, type ChatMessage, type ResponseFormatOption } from "./request.js";

type SamplingInit = Omit<MessageInitShape<typeof SessionSamplingSchema>, "$typeName" | "seed">;

/** A session's sampling defaults, or one turn's overrides. */
export interface SamplingOptions extends SamplingInit {
  seed?: number | bigint;
}

/** The settings of createSession(), fixed for the session's life. */
export interface SessionOptions {
  model?: string;
  forceExperts?: string[];
  excludeExperts?: string[];
  maxExperts?: number;
  systemPrompt?: string;
  sampling?: SamplingOptions;
  priority?: number;
  /** A first input, as append() takes it. */
  messages?: ChatMessage[];
}

/** One turn's overrides: sampling, an output format, and the turn's time limit (ms). */
export interface TurnOptions extends SamplingOptions {
  responseFormat?: ResponseFormatOption;
  timeoutMs?: number;
}

export interface TurnChunk {
  text: string;
  /** The turn moved to another engine: discard the text so far. */
  restarted: boolean;
}

function sampling(options: SamplingOptions | undefined): SessionSampling | undefined {
  if (options === undefined) return undefined;
  return create(SessionSamplingSchema, { ...options, seed: optionalBigInt(options.seed, "sampling.seed") });
}

export function sessionRequest(options: SessionOptions) {
  return { ...options, sampling: sampling(options.sampling) };
}

/** A turn's stream: `for await` its chunks; `end` holds how it ended (TurnEnd) once the loop is done. */
export class TurnStream implements AsyncIterable<TurnChunk> {
  end: TurnEnd | undefined;

  constructor(private readonly open: () => AsyncIterable<GenerateStreamResponse>) {}

  async *[Symbol.asyncIterator](): AsyncIterator<TurnChunk> {
    try {
      for await (const { event } of this.open()) {
        if (event.case === "text") yield { text: event.value, restarted: false };
        else if (event.case === "restartedAttempt") yield { text: "", restarted: true };
        else if (event.case === "end") this.end = event.value;
      }
    } catch (error) {
      throw ExpertError.from(error);
    }
  }
}

export class Session {
  constructor(
    private readonly stub: Client<typeof SessionService>,
    /** The session as created. */
    readonly info: SessionInfo,
    private readonly callOptions: () => CallOptions,
  ) {}

  get id(): string {
    return this.info.sessionId;
  }

  /** Append the next user turn: one message's text, or chat messages (roles user, system or tool). */
  async append(input: string | ChatMessage[]): Promise<SessionInfo> {
    const value = typeof input === "string"
      ? { case: "text" as const, value: input }
      : { case: "conversation" as const, value: { messages: input } };
    const response = await wrapCall(() => this.stub.appendInput({ sessionId: this.id, input: value }, this.callOptions()));
    return response.session!;
  }

  /** Generate the reply to what was appended (or go on with a cut reply), streamed. */
  generate(options: TurnOptions = {}, call: CallOptions = {}): TurnStream {
    const { responseFormat, timeoutMs, ...overrides } = options;
    const request = {
      sessionId: this.id,
      sampling: sampling(overrides),
      responseFormat: buildResponseFormat(responseFormat),
      timeoutMs: optionalBigInt(timeoutMs, "timeout_ms"),
    };
    return new TurnStream(() => this.stub.generateStream(request, call));
  }

  /** append(input), then generate() read to its end: the turn's TurnEnd (its text, usage, session). */
  async turn(input: string | ChatMessage[], options: TurnOptions = {}, call: CallOptions = {}): Promise<TurnEnd> {
    await this.append(input);
    const stream = this.generate(options, call);
    for await (const _ of stream) {
      // The text arrives whole in stream.end.
    }
    if (stream.end === undefined) throw new ExpertError("UNKNOWN", "the turn's stream ended without its end event");
    return stream.end;
  }

  /** Stop the running turn (what it generated is kept); false when none was running. */
  async cancel(): Promise<boolean> {
    const response = await wrapCall(() => this.stub.cancelGenerate({ sessionId: this.id }, this.callOptions()));
    return response.cancelled;
  }

  /** The session as the server holds it now. */
  async get(): Promise<SessionInfo> {
    const response = await wrapCall(() => this.stub.getSession({ sessionId: this.id }, this.callOptions()));
    return response.session!;
  }

  /** End the session and free what it holds; returns it as it ended. */
  async close(): Promise<SessionInfo> {
    const response = await wrapCall(() => this.stub.endSession({ sessionId: this.id }, this.callOptions()));
    return response.session!;
  }
}
