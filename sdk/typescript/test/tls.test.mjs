// The SDK's `tls` option against a real stack behind a TLS-terminating ingress (reception's own client
// port is plaintext: deployments put TLS in front of it). tests/e2e/test_typescript_sdk.py starts a
// mutual-TLS proxy (tests/helpers/tls_ingress.py) with a certificate of the stack's CA and sets
//   EXPERT_TLS_TARGET                 the proxy's host:port (127.0.0.1),
//   EXPERT_TLS_CA, _CERT, _KEY        PEM files: the CA, and a client certificate and its key,
//   EXPERT_API_KEY                    an admin key.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { ExpertClient, ExpertError, JobStatus } from "../dist/index.js";

for (const name of ["EXPERT_TLS_TARGET", "EXPERT_TLS_CA", "EXPERT_TLS_CERT", "EXPERT_TLS_KEY", "EXPERT_API_KEY"]) {
  assert.ok(process.env[name], `${name} must be set (tests/e2e/test_typescript_sdk.py sets it)`);
}
const target = process.env.EXPERT_TLS_TARGET;
const ca = readFileSync(process.env.EXPERT_TLS_CA);
const cert = readFileSync(process.env.EXPERT_TLS_CERT);
const key = readFileSync(process.env.EXPERT_TLS_KEY);

async function withClient(options, body) {
  const client = new ExpertClient({ target, defaultTimeoutMs: 10_000, ...options });
  try {
    return await body(client);
  } finally {
    client.close();
  }
}

test("over TLS with a client certificate, calls, streams and field errors work", async () => {
  // servername: the certificate names its service ("reception") as well as 127.0.0.1
  await withClient({ tls: { ca, cert, key, servername: "reception" } }, async (client) => {
    const result = await client.infer({ prompt: "Hello", temperature: 0, maxTokens: 4 });
    assert.equal(result.status, JobStatus.COMPLETED);
    const stream = client.inferStream({ prompt: "Tell me a story", temperature: 0, maxTokens: 6 });
    let text = "";
    for await (const chunk of stream) text += chunk.text;
    assert.equal(text, stream.result.text);
    // The error details (a trailer) come through the TLS hop too.
    await assert.rejects(client.infer({ prompt: "Hi", temperature: 9 }), (error) => {
      assert.ok(error instanceof ExpertError && error.code === "INVALID_ARGUMENT", String(error));
      assert.ok(error.fieldViolations.some((v) => v.field.endsWith("temperature")));
      return true;
    });
    assert.ok((await client.keys.list()).length >= 1);
  });
});

async function refusedTls(options, why) {
  await withClient({ tls: options }, async (client) => {
    await assert.rejects(client.infer({ prompt: "Hello", maxTokens: 2 }), (error) => {
      assert.ok(error instanceof ExpertError, String(error));
      assert.equal(error.code, "UNAVAILABLE", String(error));
      assert.match(error.message, why);
      return true;
    });
  });
}

test("a server whose certificate the given CA did not sign is refused: UNAVAILABLE", async () => {
  // Node's own trust store (no `ca`): the stack's local CA is not in it.
  await refusedTls({ cert, key }, /TLS handshake failed \(UNABLE_TO_VERIFY_LEAF_SIGNATURE\)/);
});

test("a servername the server's certificate does not name is refused: UNAVAILABLE", async () => {
  await refusedTls({ ca, cert, key, servername: "router" }, /TLS handshake failed \(ERR_TLS_CERT_ALTNAME_INVALID\)/);
});

test("without a client certificate the mutual-TLS server refuses the call", async () => {
  // The server's refusal comes after the client's side of the handshake, as a reset stream:
  // Connect reports it as CANCELLED (there is no TLS error on this side to map).
  await withClient({ tls: { ca } }, async (client) => {
    await assert.rejects(client.infer({ prompt: "Hello", maxTokens: 2 }), (error) => {
      assert.ok(error instanceof ExpertError, String(error));
      assert.ok(["CANCELLED", "UNAVAILABLE"].includes(error.code), String(error));
      return true;
    });
  });
});

test("a plaintext client cannot talk to the TLS port", async () => {
  await withClient({}, async (client) => {
    await assert.rejects(client.infer({ prompt: "Hello", maxTokens: 2 }), (error) => error instanceof ExpertError);
  });
});
