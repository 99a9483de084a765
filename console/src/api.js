// The console's one way to the API: every call with the key as a bearer token (never a
// cookie), errors as the API's problem+json, and the request id of each failure kept so a
// message can name it.
const KEY = "space.key";

export function savedKey() {
  return sessionStorage.getItem(KEY);
}

export function saveKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export class APIError extends Error {
  constructor(status, detail, requestId, body) {
    super(detail);
    this.status = status;
    this.requestId = requestId;
    this.body = body || {};
  }
}

let onSignedOut = () => {};
export function whenSignedOut(fn) {
  onSignedOut = fn;
}

async function failure(resp, withSavedKey) {
  let body = {};
  try {
    body = await resp.json();
  } catch {
    body = {};
  }
  const detail = body.detail || body.title || `${resp.status} ${resp.statusText}`;
  const err = new APIError(resp.status, detail, resp.headers.get("x-request-id"), body);
  if (resp.status === 401 && withSavedKey) onSignedOut(err);
  return err;
}

export async function call(method, path, { body, raw, key, signal, query } = {}) {
  const headers = { Authorization: `Bearer ${key || savedKey()}` };
  let payload;
  if (raw !== undefined) {
    payload = raw;
    headers["Content-Type"] = "application/octet-stream";
  } else if (body !== undefined) {
    payload = JSON.stringify(body);
    headers["Content-Type"] = "application/json";
  }
  let url = path;
  if (query) {
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) {
      if (v !== undefined && v !== null && v !== "") params.append(k, v);
    }
    const text = params.toString();
    if (text) url += `?${text}`;
  }
  let resp;
  try {
    resp = await fetch(url, { method, headers, body: payload, signal, credentials: "omit" });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new APIError(0, "The API cannot be reached. Is it running?", null);
  }
  if (!resp.ok) throw await failure(resp, !key);
  return resp;
}

export async function json(method, path, options) {
  const resp = await call(method, path, options);
  return resp.status === 204 ? null : resp.json();
}

export const get = (path, options) => json("GET", path, options);

// A text stream (a build log), handed over chunk by chunk until it ends.
export async function stream(path, onText, signal) {
  const resp = await call("GET", path, { signal });
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    onText(decoder.decode(value, { stream: true }));
  }
}

// An NDJSON stream (a process's output, a sandbox's events): each line parsed and handed over
// as it comes, until the stream ends.
export async function ndjson(path, onItem, signal) {
  let pending = "";
  await stream(
    path,
    (text) => {
      pending += text;
      const lines = pending.split("\n");
      pending = lines.pop();
      for (const line of lines) if (line) onItem(JSON.parse(line));
    },
    signal,
  );
}

export async function download(path, name) {
  const resp = await call("GET", path);
  const url = URL.createObjectURL(await resp.blob());
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// A browser cannot set headers on a WebSocket: the key goes in the query, as the API allows.
export function socketURL(path) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${path}?token=${encodeURIComponent(savedKey())}`;
}

export const sandboxPath = (id, rest = "") => `/v1/sandboxes/${encodeURIComponent(id)}${rest}`;
