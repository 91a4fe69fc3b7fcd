// Downloading a model (GET /v1/models/{id}/content): fetched with the key, its SHA-256 checked against
// X-Checksum-SHA256 where the browser offers WebCrypto (https or localhost), then saved as a .tar.
// The tar is held in the browser's memory first; for very large models use curl (docs/api.md).

import { api, seg } from "./api.js";
import { bytes, h } from "./dom.js";
import { showError, showInfo } from "./errors.js";

async function sha256Hex(blob) {
  const digest = await crypto.subtle.digest("SHA-256", await blob.arrayBuffer());
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join("");
}

/** Download ``modelId`` (``adapter``: its LoRA adapter), reporting progress in ``status``. */
export async function downloadModel(modelId, status, { adapter = false } = {}) {
  const name = `${modelId.replace(/[^A-Za-z0-9._-]+/g, "_")}${adapter ? "-adapter" : ""}.tar`;
  try {
    showInfo(status, `Downloading ${name}...`);
    const response = await api(`/models/${seg(modelId)}/content`,
      { query: { format: adapter ? "adapter" : undefined } });
    const total = Number(response.headers.get("Content-Length")) || 0;
    const expected = response.headers.get("X-Checksum-SHA256");
    const reader = response.body.getReader();
    const chunks = [];
    let received = 0;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      chunks.push(value);
      received += value.length;
      showInfo(status, `Downloading ${name}: ${bytes(received)}${total ? ` of ${bytes(total)}` : ""}`);
    }
    if (total && received !== total) throw new Error(`The download ended after ${received} of ${total} bytes`);
    const blob = new Blob(chunks, { type: "application/x-tar" });
    let check = "checksum not verified (WebCrypto needs https or localhost)";
    if (expected && globalThis.crypto?.subtle) {
      const got = await sha256Hex(blob);
      if (got !== expected) throw new Error(`Checksum mismatch: expected ${expected}, got ${got}`);
      check = "SHA-256 verified";
    }
    const url = URL.createObjectURL(blob);
    const link = h("a", { href: url, download: name, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
    showInfo(status, `Saved ${name} (${bytes(received)}, ${check}).`);
  } catch (err) {
    showError(status, err);
  }
}
