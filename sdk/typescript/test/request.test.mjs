// Options -> InferenceRequest, without a server: what the client sends is checked on the message
// itself, serialised and read back as the server reads it.
import assert from "node:assert/strict";
import { test } from "node:test";
import { fromBinary, toBinary } from "@bufbuild/protobuf";
import { ExpertError, InferenceRequestSchema } from "../dist/index.js";
import { buildRequest } from "../dist/request.js";

function roundTrip(options) {
  return fromBinary(InferenceRequestSchema, toBinary(InferenceRequestSchema, buildRequest(options)));
}

test("options left out stay unset, and the ones given are sent, zero included", () => {
  const request = roundTrip({ prompt: "Hi", temperature: 0, maxTokens: 16, timeoutMs: 5000, seed: 7 });
  assert.equal(request.temperature, 0);
  assert.equal(request.maxTokens, 16);
  assert.equal(request.timeoutMs, 5000n);
  assert.equal(request.seed, 7n);
  assert.equal(request.topP, undefined);
  assert.equal(request.responseFormat, undefined);
});

test("responseFormat in OpenAI's shape and the jsonSchema shorthand become the proto's formats", () => {
  const schema = { type: "object", properties: { name: { type: "string" } } };
  const request = roundTrip({ prompt: "x", responseFormat: { type: "json_schema", json_schema: { name: "person", schema } } });
  assert.equal(request.responseFormat.format.case, "jsonSchema");
  assert.deepEqual(JSON.parse(request.responseFormat.format.value.schema), schema);
  assert.equal(request.responseFormat.format.value.name, "person");
  assert.equal(roundTrip({ prompt: "x", responseFormat: { type: "regex", regex: "(yes|no)" } }).responseFormat.format.value, "(yes|no)");
  assert.equal(roundTrip({ prompt: "x", responseFormat: { type: "json_object" } }).responseFormat.format.case, "jsonObject");
  assert.equal(roundTrip({ prompt: "x", responseFormat: { type: "text" } }).responseFormat, undefined);
  assert.deepEqual(JSON.parse(roundTrip({ prompt: "x", jsonSchema: schema }).jsonSchema), schema);
});

test("a non-integer int64 option is refused with the field named", () => {
  assert.throws(() => buildRequest({ prompt: "x", timeoutMs: 1.5 }), (error) => {
    assert.ok(error instanceof ExpertError);
    assert.equal(error.code, "INVALID_ARGUMENT");
    assert.deepEqual(error.fieldViolations.map((v) => v.field), ["request.timeout_ms"]);
    return true;
  });
});
