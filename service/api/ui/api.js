// The controller's JSON API (/v1), called with the bearer token this tab keeps in sessionStorage (never in a URL
// or a cookie), sent as "Authorization: Bearer".

export const TOKEN_KEY = "etrain.token";

/** The tab's token, and whether the controller asks for one (``ui/config.json``). */
export const auth = { token: sessionStorage.getItem(TOKEN_KEY), required: true };

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}
export class AuthError extends ApiError {}

// relative to /ui/: works behind an ingress that serves the controller under a path prefix
export const apiUrl = (path) => new URL(`../${path}`, window.location.href);

async function errorDetail(resp) {
  try {
    const body = await resp.json();
    if (typeof body.message === "string" && body.message) return body.message;
    return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch {
    return resp.statusText;
  }
}

export async function call(path, token = auth.token) {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  let resp;
  try {
    resp = await fetch(apiUrl(path), { headers, cache: "no-store", credentials: "omit" });
  } catch (err) {
    throw new ApiError(0, `cannot reach the controller (${err.message})`);
  }
  if (resp.status === 401) throw new AuthError(401, await errorDetail(resp));
  if (!resp.ok) throw new ApiError(resp.status, `HTTP ${resp.status}: ${await errorDetail(resp)}`);
  return resp;
}
export const api = async (path, token) => (await call(path, token)).json();

export async function allJobs() {
  let jobs = [];
  let after = null;
  for (let page = 0; page < 20; page++) {
    const body = await api(`v1/jobs?limit=1000${after ? `&after=${encodeURIComponent(after)}` : ""}`);
    jobs = jobs.concat(body.jobs);
    if (!body.next) break;
    after = body.next;
  }
  return jobs;
}
