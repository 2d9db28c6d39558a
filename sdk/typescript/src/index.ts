// @expert-system/sdk: the TypeScript client of the Expert System (docs/api.md#typescript-sdk).
export { ExpertClient } from "./client.js";
export {
  API_KEY_ENV,
  DEFAULT_TARGET,
  DEFAULT_TIMEOUT_MS,
  TARGET_ENV,
  bearerInterceptor,
  type ConnectionOptions,
} from "./connection.js";
export { ExpertError, type FieldViolation, type StatusName } from "./errors.js";
export { Keys, type CreateKeyOptions, type CreatedKey } from "./keys.js";
export type { ChatMessage, InferOptions, ResponseFormatOption } from "./request.js";
export { Session, TurnStream, type SamplingOptions, type SessionOptions, type TurnChunk, type TurnOptions } from "./session.js";
export { InferStream, type StreamChunk } from "./stream.js";
// The generated messages and enums the client returns, for their types and enum values.
export * from "./gen/expert/v1/common_pb.js";
export * from "./gen/expert/v1/inference_pb.js";
export * from "./gen/expert/v1/keys_pb.js";
export * from "./gen/expert/v1/session_pb.js";
// session_pb.js's Session message (the session as the server holds it), beside the Session class.
export type { Session as SessionInfo } from "./gen/expert/v1/session_pb.js";
