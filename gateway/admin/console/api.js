// The admin API client: every call carries the admin token as a header, every failure
// becomes an ApiError holding the API's OpenAI-shaped error (message, type, param, code).

const TOKEN_KEY = "tiergate.adminToken";
const API_ROOT = "/admin/v1";

let onUnauthorized = () => {};

export class ApiError extends Error {
  constructor(status, { message, type = null, param = null, code = null }) {
    super(message);
    this.name = "ApiError";
    this.status = status; // HTTP status, 0 when the gateway could not be reached
    this.type = type;
    this.param = param; // the offending field, e.g. "quota.requests_per_minute"
    this.code = code;
  }

  // The route does not exist on this gateway (an older or partial build): the router's 404
  // carries no code, unlike an unknown tenant or a disabled admin API.
  get isMissingRoute() {
    return this.status === 404 && this.code === null;
  }
}

// The token lives in sessionStorage: gone when the tab closes, never sent by the browser on
// its own (unlike a cookie), so other sites cannot ride it.
export function storedToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function storeToken(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
}

export function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

// Called when the stored token is refused (rotated on the server): the page signs out.
export function setUnauthorizedHandler(handler) {
  onUnauthorized = handler;
}

function url(path, query) {
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(query ?? {})) {
    if (value !== null && value !== undefined && value !== "") params.set(name, String(value));
  }
  const search = params.toString();
  return `${API_ROOT}${path}${search ? `?${search}` : ""}`;
}

// An uploaded file goes as it is, with its own type; never as JSON, which the API would parse.
function uploadType(file) {
  const type = file.type ?? "";
  return type && !type.startsWith("application/json") ? type : "application/octet-stream";
}

async function send(method, path, { query, body, file, token } = {}) {
  const usesStoredToken = token === undefined;
  const headers = { "x-admin-token": usesStoredToken ? (storedToken() ?? "") : token };
  let payload;
  if (file !== undefined) {
    headers["content-type"] = uploadType(file);
    payload = file;
  } else if (body !== undefined) {
    headers["content-type"] = "application/json";
    payload = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url(path, query), {
      method,
      headers,
      body: payload,
      cache: "no-store",
      credentials: "omit",
    });
  } catch (err) {
    throw new ApiError(0, { message: `Could not reach the gateway (${err.message}).` });
  }
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401 && usesStoredToken) onUnauthorized(error);
    throw error;
  }
  return response;
}

async function errorOf(response) {
  let error = null;
  try {
    error = (await response.json()).error ?? null;
  } catch {
    // not JSON: a proxy or load balancer answered
  }
  if (error && typeof error.message === "string") return new ApiError(response.status, error);
  const reason = response.statusText || "error";
  return new ApiError(response.status, { message: `HTTP ${response.status} ${reason}` });
}

// JSON of a successful call; options: query (object), body (JSON) or file (a Blob sent as the
// raw body), token (overrides the stored one).
export async function api(method, path, options) {
  const response = await send(method, path, options);
  return response.status === 204 ? null : response.json();
}

// A file download: the body as a Blob and the name the server suggests.
export async function apiFile(path, query) {
  const response = await send("GET", path, { query });
  const disposition = response.headers.get("content-disposition") ?? "";
  const match = /filename="?([^";]+)"?/.exec(disposition);
  return { blob: await response.blob(), filename: match ? match[1] : null };
}
