// The etrain dashboard: a static page that reads the controller's JSON API (/v1) with a bearer token.
//
// The token is asked for once per tab and kept in sessionStorage (never in a URL or a cookie); every API call
// sends it as "Authorization: Bearer". Pages: #/jobs (the list), #/jobs/<id> (one job), #/nodes. No library,
// no request to any other host: charts are SVG drawn here. Text from the API is only ever set as text.
//
// ES modules, served as they are (no build step): this one signs in, routes and starts; api.js (the API and the
// token), dom.js (DOM helpers and formats), shell.js (the page around the views, polling), charts.js (SVG
// charts), jobs-view.js, nodes-view.js and job-view.js (the pages; job-panels.js: the job page's event panels).
import { api, auth, AuthError, TOKEN_KEY } from "./api.js";
import { $ } from "./dom.js";
import { jobView } from "./job-view.js";
import { jobsView } from "./jobs-view.js";
import { nodesView } from "./nodes-view.js";
import { banner, forgetToken, showAuthState, showLogin, showView, stopView } from "./shell.js";

async function onLogin(event) {
  event.preventDefault();
  const input = $("token-input");
  const token = input.value.trim();
  if (!token) return;
  $("token-submit").disabled = true;
  try {
    await api("v1/jobs?limit=1", token);
  } catch (err) {
    const message =
      err instanceof AuthError
        ? `Authentication failed: the controller refused this token (HTTP 401: ${err.message}).`
        : `Could not check the token: ${err.message}`;
    showLogin(message);
    input.select();
    return;
  } finally {
    $("token-submit").disabled = false;
  }
  auth.token = token;
  sessionStorage.setItem(TOKEN_KEY, token);
  input.value = "";
  $("login").hidden = true;
  showAuthState();
  route();
}

function decodeId(text) {
  try {
    return decodeURIComponent(text);
  } catch {
    return text; // not %-encoded as we write it: show it as typed
  }
}

function route() {
  stopView();
  if (auth.required && !auth.token) {
    showLogin();
    return;
  }
  $("login").hidden = true;
  banner("");
  const view = $("view");
  view.replaceChildren();
  const hash = window.location.hash || "#/jobs";
  const job = hash.match(/^#\/jobs\/([^/]+)$/);
  $("nav-jobs").classList.toggle("active", !hash.startsWith("#/nodes"));
  $("nav-nodes").classList.toggle("active", hash.startsWith("#/nodes"));
  if (job) showView(jobView(view, decodeId(job[1])));
  else if (hash === "#/nodes") showView(nodesView(view));
  else showView(jobsView(view));
}

// -- start ---------------------------------------------------------------------------------------------------
async function start() {
  $("login-form").addEventListener("submit", onLogin);
  $("sign-out").addEventListener("click", () => forgetToken());
  window.addEventListener("hashchange", route);
  try {
    const config = await api("ui/config.json", null);
    auth.required = config.auth_required;
  } catch (err) {
    banner(err.message); // assume a token is needed
  }
  showAuthState();
  route();
}

start();
