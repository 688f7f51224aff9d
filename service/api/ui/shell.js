// The page's shell around the views: the signed-in line, the sign-in form, the error banner, the view on screen
// and the polling that redraws it.
import { auth, AuthError, TOKEN_KEY } from "./api.js";
import { $, clock } from "./dom.js";

export const POLL_MS = { jobs: 3000, job: 2000, nodes: 5000 };

let current = null; // the view on screen: { stop() }

/** Stops the view on screen, if any. */
export function stopView() {
  if (current) current.stop();
  current = null;
}

/** Makes ``view`` (``{ stop() }``) the view on screen. */
export function showView(view) {
  current = view;
}

export function showAuthState() {
  const signedIn = Boolean(auth.token);
  $("auth-state").textContent = !auth.required
    ? "authentication is off on this controller"
    : signedIn
      ? "signed in with a token (kept in this tab only)"
      : "";
  $("sign-out").hidden = !signedIn;
}

export function showLogin(message) {
  stopView();
  $("view").replaceChildren();
  $("error-banner").hidden = true;
  $("login").hidden = false;
  const error = $("login-error");
  error.textContent = message || "";
  error.hidden = !message;
  showAuthState();
  $("token-input").focus();
}

export function forgetToken(message) {
  auth.token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  showLogin(message);
}

export function banner(message) {
  const el = $("error-banner");
  el.textContent = message || "";
  el.hidden = !message;
}

/** Calls ``refresh`` now and every ``ms`` until stopped (never two at once); ``refresh`` returning false stops. */
export function poll(refresh, ms) {
  let stopped = false;
  let timer = null;
  async function tick() {
    if (stopped) return;
    let again = true;
    try {
      again = (await refresh()) !== false;
      if (stopped) return;
      banner("");
      $("updated").textContent = `updated ${clock(Date.now())}, every ${ms / 1000} s`;
    } catch (err) {
      if (stopped) return;
      if (err instanceof AuthError) {
        forgetToken(`Authentication failed: the controller refused the token (HTTP 401: ${err.message}). Sign in again.`);
        return;
      }
      banner(err.message);
    }
    if (again && !stopped) timer = setTimeout(tick, ms);
  }
  tick();
  return {
    stop() {
      stopped = true;
      clearTimeout(timer);
    },
  };
}
