// The SDK against a real stack (never mocks): tests/e2e/test_typescript_sdk.py starts one with
// EXPERT_AUTH=required and runs `npm test` with
//   EXPERT_RECEPTION_TARGET  the reception's host:port,
//   EXPERT_API_KEY           an admin key (the client sends it by default).
import assert from "node:assert/strict";
import { after, test } from "node:test";
import { ExpertClient, ExpertError, FinishReason, JobStatus, SessionState } from "../dist/index.js";

for (const name of ["EXPERT_RECEPTION_TARGET", "EXPERT_API_KEY"]) {
  assert.ok(process.env[name], `${name} must be set (tests/e2e/test_typescript_sdk.py sets it)`);
}
// A job held to this regex cannot end (no end of sequence is allowed) before its output has 600
// characters, hundreds of tokens.
const LONG_FORMAT = { type: "regex", regex: "(ab ){200}" };
const LONG = 1000;
const CANCEL_TRIES = 5;
const FINAL = new Set([JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMED_OUT]);
const client = new ExpertClient();
after(() => client.close());

async function waitFinal(jobId) {
  const deadline = Date.now() + 60_000;
  while (Date.now() < deadline) {
    const job = await client.getJob(jobId);
    if (FINAL.has(job.status)) return job;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  assert.fail(`job ${jobId} never ended`);
}

test("infer returns the job's result", async () => {
  const result = await client.infer({ prompt: "Hello", temperature: 0, maxTokens: 8 });
  assert.equal(result.status, JobStatus.COMPLETED);
  assert.ok(result.jobId);
  assert.ok(result.tokensGenerated > 0 && result.tokensGenerated <= 8, `${result.tokensGenerated} tokens`);
  assert.ok(Array.isArray(result.expertsUsed));
  assert.equal(typeof result.text, "string");
  assert.ok(result.latencyMs > 0);
});

test("inferStream yields the text with for await, then the result", async () => {
  const stream = client.inferStream({ prompt: "Tell me a story", temperature: 0, maxTokens: 12 });
  let text = "";
  let chunks = 0;
  for await (const chunk of stream) {
    assert.equal(chunk.restarted, false);
    text += chunk.text;
    chunks += 1;
  }
  assert.ok(chunks >= 1);
  assert.equal(stream.result.status, JobStatus.COMPLETED);
  assert.equal(text, stream.result.text);
  assert.equal(stream.jobId, stream.result.jobId);
});

test("submit queues a job that getJob follows to its result", async () => {
  const submission = await client.submit({ prompt: "Hi", temperature: 0, maxTokens: 6 });
  assert.ok(submission.jobId);
  const job = await waitFinal(submission.jobId);
  assert.equal(job.status, JobStatus.COMPLETED);
  assert.equal(job.text, job.result.text);
});

test("cancel stops a job that would run for hundreds of tokens", async () => {
  // The tiny test model makes hundreds of tokens in well under a second, so on a loaded machine a
  // cancel sent right after the submit can arrive after the job ended (it then stays COMPLETED, as
  // it should). Each try that loses that race is run again; a cancel that never stops a job fails.
  for (let attempt = 1; attempt <= CANCEL_TRIES; attempt += 1) {
    const submission = await client.submit({ prompt: "Say ab", maxTokens: LONG, responseFormat: LONG_FORMAT });
    const cancelled = await client.cancel(submission.jobId);
    assert.equal(cancelled.jobId, submission.jobId);
    const job = await waitFinal(submission.jobId);
    if (job.status === JobStatus.COMPLETED && attempt < CANCEL_TRIES) continue; // ended before the cancel
    assert.equal(job.status, JobStatus.CANCELLED);
    assert.equal(job.result.finishReason, FinishReason.ABORT);
    assert.ok(job.result.tokensGenerated < LONG && job.result.text.length < 600, job.result.text);
    return;
  }
});

test("a deadline shorter than the job ends the call with DEADLINE_EXCEEDED", async () => {
  // 1 ms: no job runs through five services in that.
  const call = client.infer({ prompt: "Hello", temperature: 0, maxTokens: 8 }, { timeoutMs: 1 });
  await assert.rejects(call, (error) => error instanceof ExpertError && error.code === "DEADLINE_EXCEEDED");
});

test("a session keeps its conversation over two turns", async () => {
  const session = await client.createSession({
    systemPrompt: "You answer briefly.",
    sampling: { temperature: 0, maxNewTokens: 6 },
  });
  try {
    const first = await session.turn("What is a lighthouse?");
    assert.equal(first.session.turns, 1);
    assert.ok(first.usage.completionTokens > 0);
    await session.append("And a harbour?");
    const stream = session.generate({ maxNewTokens: 4 });
    let text = "";
    for await (const chunk of stream) text += chunk.text;
    const second = stream.end;
    assert.equal(text, second.text);
    assert.equal(second.session.turns, 2);
    // The second turn's prompt starts with the first turn's tokens, kept on the engine.
    assert.ok(second.usage.cachedTokens > 0, `cached ${second.usage.cachedTokens}`);
    assert.ok(second.usage.completionTokens <= 4);
    assert.equal((await session.get()).turns, 2);
  } finally {
    assert.equal((await session.close()).state, SessionState.ENDED);
  }
  await assert.rejects(session.get(), (error) => error.code === "NOT_FOUND");
});

test("an invalid field is a typed ExpertError naming the field", async () => {
  await assert.rejects(client.infer({ prompt: "Hi", temperature: 9 }), (error) => {
    assert.ok(error instanceof ExpertError);
    assert.equal(error.code, "INVALID_ARGUMENT");
    assert.ok(
      error.fieldViolations.some((v) => v.field.endsWith("temperature") && v.description),
      JSON.stringify(error.fieldViolations),
    );
    return true;
  });
});

test("an API key is created, used, listed and revoked", async () => {
  const { key, secret } = await client.keys.create({ name: "typescript sdk test", scope: "infer" });
  assert.match(secret, /^esk_/);
  const user = new ExpertClient({ apiKey: secret });
  try {
    const result = await user.infer({ prompt: "Hello", temperature: 0, maxTokens: 2 });
    assert.equal(result.status, JobStatus.COMPLETED);
    // An infer key may not manage keys.
    await assert.rejects(user.keys.list(), (error) => error.code === "PERMISSION_DENIED");
    const listed = await client.keys.list();
    assert.ok(listed.some((k) => k.keyId === key.keyId && k.revokedAt === undefined));
    const revoked = await client.keys.revoke(key.keyId);
    assert.ok(revoked.revokedAt);
    await assert.rejects(user.infer({ prompt: "Hello", maxTokens: 2 }), (error) => error.code === "UNAUTHENTICATED");
  } finally {
    user.close();
  }
});
