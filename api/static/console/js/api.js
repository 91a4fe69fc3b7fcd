// The /v1 API from the browser: the pasted key, the OpenAI error object, and server-sent events over
// fetch (EventSource cannot send an Authorization header).

const KEY_NAME = "zenflow.apiKey";

/** The key in use: this tab's (sessionStorage) first, else the one remembered on this device. */
export function getKey() {
  return sessionStorage.getItem(KEY_NAME) ?? localStorage.getItem(KEY_NAME) ?? "";
}

/** Keep ``key`` for this tab, or with ``remember`` on this device (localStorage) too. */
export function setKey(key, remember) {
  forgetKey();
  sessionStorage.setItem(KEY_NAME, key);
  if (remember) localStorage.setItem(KEY_NAME, key);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
}

export function keyRemembered() {
  return localStorage.getItem(KEY_NAME) !== null;
}

/** An answer other than 2xx: the server's ``{"error": {...}}`` as fields. */
export class ApiError extends Error {
  constructor(status, body, retryAfter) {
    const err = (body && typeof body === "object" && body.error) || {};
    super(typeof err.message === "string" ? err.message : `HTTP ${status}`);
    this.status = status;
    this.code = err.code ?? null;
    this.param = err.param ?? null;
    this.errors = Array.isArray(err.errors) ? err.errors : [];
    this.retryAfter = retryAfter;
  }
}

/** ``/v1`` + path, with the key. ``json``: a JSON body; ``form``: FormData; ``query``: parameters. */
export async function api(path, { method = "GET", json, form, query, headers = {}, signal } = {}) {
  const url = new URL(`/v1${path}`, window.location.origin);
  for (const [k, v] of Object.entries(query ?? {})) {
    if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, String(v));
  }
  const allHeaders = { Authorization: `Bearer ${getKey()}`, ...headers };
  let body;
  if (json !== undefined) {
    body = JSON.stringify(json);
    allHeaders["Content-Type"] = "application/json";
  } else if (form !== undefined) {
    body = form;
  }
  let response;
  try {
    response = await fetch(url, { method, headers: allHeaders, body, signal, cache: "no-store" });
  } catch (exc) {
    if (exc.name === "AbortError") throw exc;
    throw new ApiError(0, { error: { message: `The server could not be reached (${exc.message})` } });
  }
  if (!response.ok) {
    let payload = null;
    try { payload = await response.json(); } catch { /* not JSON: the status says it */ }
    throw new ApiError(response.status, payload, response.headers.get("Retry-After"));
  }
  return response;
}

/** ``api`` and the JSON body. */
export async function apiJson(path, options) {
  return (await api(path, options)).json();
}

/** Every item of a list endpoint that pages with ``after`` (``has_more``), up to ``max`` items. */
export async function listAll(path, { query = {}, max = 1000 } = {}) {
  const items = [];
  let after;
  for (;;) {
    const page = await apiJson(path, { query: { ...query, after } });
    items.push(...page.data);
    if (!page.has_more || page.data.length === 0 || items.length >= max) return items;
    after = page.data[page.data.length - 1].id;
  }
}

/**
 * The server-sent events of a streaming response, one ``{id, event, data}`` at a time (``data``: the
 * joined ``data:`` lines; comments are skipped).
 */
export async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { id: null, event: null, data: [] };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line === "") {
          if (event.data.length) yield { id: event.id, event: event.event, data: event.data.join("\n") };
          event = { id: null, event: null, data: [] };
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") event.data.push(text);
        else if (field === "id") event.id = text;
        else if (field === "event") event.event = text;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/** A path segment for an id (model ids hold ':' and base model names '/'). */
export const seg = (id) => encodeURIComponent(id);
