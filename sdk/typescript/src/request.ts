// Options in TypeScript's idiom -> InferenceRequest. Most options are the request's own fields,
// camelCased as protobuf-es names them; an option left out stays unset, so the router decides it.
// What differs: int64 fields (timeoutMs, seed) take a plain number, `jsonSchema` takes an object or
// JSON text, and `responseFormat` takes OpenAI's shape (plus regex and grammar).
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { ExpertError } from "./errors.js";
import {
  InferenceRequestSchema,
  ResponseFormatSchema,
  type InferenceRequest,
  type ResponseFormat,
} from "./gen/expert/v1/common_pb.js";

export interface ChatMessage {
  role: "system" | "user" | "assistant" | "tool" | (string & {});
  content: string;
}

/** A constraint on the output (docs/api.md#structured-output), in OpenAI's shape. */
export type ResponseFormatOption =
  | { type: "text" }
  | { type: "json_object" }
  | {
      type: "json_schema";
      json_schema: { name?: string; schema: object | string; strict?: boolean; description?: string };
    }
  | { type: "regex"; regex: string }
  | { type: "grammar"; grammar: string };

type RequestInit = MessageInitShape<typeof InferenceRequestSchema>;
type Replaced = "$typeName" | "timeoutMs" | "seed" | "jsonSchema" | "responseFormat" | "messages";

/** The request of infer, inferStream and submit: InferenceRequest's fields (docs/api.md). */
export interface InferOptions extends Omit<RequestInit, Replaced> {
  /** Longest the job may take end to end, in ms; on expiry the partial output is returned. */
  timeoutMs?: number;
  seed?: number | bigint;
  messages?: ChatMessage[];
  /** A JSON schema the output must satisfy (an object, or JSON text). */
  jsonSchema?: object | string;
  responseFormat?: ResponseFormatOption;
}

export function buildRequest(options: InferOptions): InferenceRequest {
  const { timeoutMs, seed, jsonSchema, responseFormat, ...fields } = options;
  return create(InferenceRequestSchema, {
    ...fields,
    timeoutMs: optionalBigInt(timeoutMs, "request.timeout_ms"),
    seed: optionalBigInt(seed, "request.seed"),
    jsonSchema: jsonSchema === undefined || typeof jsonSchema === "string" ? jsonSchema : JSON.stringify(jsonSchema),
    responseFormat: buildResponseFormat(responseFormat),
  });
}

/** An int64 field's value; anything but an integer is refused here, as the server would refuse it,
 * with the field named: BigInt() alone would throw a RangeError that names nothing. */
export function optionalBigInt(value: number | bigint | undefined, field: string): bigint | undefined {
  if (value === undefined || typeof value === "bigint") return value;
  if (!Number.isSafeInteger(value)) {
    const description = `must be an integer, got ${value}`;
    throw new ExpertError("INVALID_ARGUMENT", `${field}: ${description}`, [{ field, description }]);
  }
  return BigInt(value);
}

export function buildResponseFormat(option: ResponseFormatOption | undefined): ResponseFormat | undefined {
  if (option === undefined || option.type === "text") return undefined;
  switch (option.type) {
    case "json_object":
      return create(ResponseFormatSchema, { format: { case: "jsonObject", value: {} } });
    case "json_schema": {
      const { schema, name, strict, description } = option.json_schema;
      const text = typeof schema === "string" ? schema : JSON.stringify(schema);
      return create(ResponseFormatSchema, {
        format: { case: "jsonSchema", value: { schema: text, name, strict, description } },
      });
    }
    case "regex":
      return create(ResponseFormatSchema, { format: { case: "regex", value: option.regex } });
    case "grammar":
      return create(ResponseFormatSchema, { format: { case: "grammar", value: option.grammar } });
  }
}
