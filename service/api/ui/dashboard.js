// The etrain dashboard: a static page that reads the controller's JSON API (/v1) with a bearer token.
//
// The token is asked for once per tab and kept in sessionStorage (never in a URL or a cookie); every API call
// sends it as "Authorization: Bearer". Pages: #/jobs (the list), #/jobs/<id> (one job), #/nodes. No library,
// no request to any other host: charts are SVG drawn here. Text from the API is only ever set as text.
"use strict";

(() => {
  const TOKEN_KEY = "etrain.token";
  const MAX_SERIES = 1500; // windows + points asked of GET /v1/jobs/{id}/metrics when a job's page opens
  const MAX_MARKS = 200; // marks (world-size changes, restarts, snapshots) drawn on each chart's time axis
  const POLL_MS = { jobs: 3000, job: 2000, nodes: 5000 };
  const LOG_LINES = 200; // the job page shows the last lines of the job's logs
  const LOG_TAIL_BYTES = 32768; // asked of each node (GET /v1/jobs/{id}/logs?tail=)
  const SVG_NS = "http://www.w3.org/2000/svg";

  const auth = { token: sessionStorage.getItem(TOKEN_KEY), required: true };
  let current = null; // the view on screen: { stop() }

  // -- DOM helpers (text is always a text node: nothing from the API is parsed as HTML) ---------------------
  const $ = (id) => document.getElementById(id);

  function fill(el, attrs, children) {
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else el.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }
  const h = (tag, attrs, ...children) => fill(document.createElement(tag), attrs, children);
  const svg = (tag, attrs, ...children) => fill(document.createElementNS(SVG_NS, tag), attrs, children);
  /** Replaces ``el``'s children (skipping null and false: replaceChildren would show them as text). */
  function put(el, ...children) {
    el.replaceChildren();
    return fill(el, {}, children);
  }

  function pad(n) {
    return String(n).padStart(2, "0");
  }
  function clock(ms) {
    const d = new Date(ms);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }
  function when(iso) {
    if (!iso) return "–";
    const d = new Date(iso);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${clock(d.getTime())}`;
  }
  function ago(iso) {
    if (!iso) return "–";
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return `${(s / 86400).toFixed(1)} d ago`;
  }
  function num(v, digits = 4) {
    if (v === null || v === undefined) return "–";
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : String(Number(v.toPrecision(digits)));
  }
  const dash = (v) => (v === null || v === undefined ? "–" : String(v));
  const jobHref = (id) => `#/jobs/${encodeURIComponent(id)}`;
  const stateBadge = (state) => h("span", { class: `state state-${state}` }, state);

  function progressBar(step, total) {
    const bar = h("span", { class: "bar-fill" });
    const pct = step !== null && step !== undefined && total ? Math.min(100, (100 * step) / total) : 0;
    bar.style.width = `${pct.toFixed(1)}%`; // CSSOM, not a style attribute: allowed by the CSP
    const text = step === null || step === undefined ? "–" : total ? `${step} / ${total}` : String(step);
    return h("span", { class: "progress" }, h("span", { class: "bar" }, bar), h("span", { class: "progress-text" }, text));
  }

  // -- the API -------------------------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }
  class AuthError extends ApiError {}

  // relative to /ui/: works behind an ingress that serves the controller under a path prefix
  const apiUrl = (path) => new URL(`../${path}`, window.location.href);

  async function errorDetail(resp) {
    try {
      const body = await resp.json();
      if (typeof body.message === "string" && body.message) return body.message;
      return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch {
      return resp.statusText;
    }
  }

  async function call(path, token = auth.token) {
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
  const api = async (path, token) => (await call(path, token)).json();

  async function allJobs() {
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

  // -- sign-in -------------------------------------------------------------------------------------------------
  function showAuthState() {
    const signedIn = Boolean(auth.token);
    $("auth-state").textContent = !auth.required
      ? "authentication is off on this controller"
      : signedIn
        ? "signed in with a token (kept in this tab only)"
        : "";
    $("sign-out").hidden = !signedIn;
  }

  function showLogin(message) {
    if (current) current.stop();
    current = null;
    $("view").replaceChildren();
    $("error-banner").hidden = true;
    $("login").hidden = false;
    const error = $("login-error");
    error.textContent = message || "";
    error.hidden = !message;
    showAuthState();
    $("token-input").focus();
  }

  function forgetToken(message) {
    auth.token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin(message);
  }

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

  // -- views: each polls, then redraws its parts ---------------------------------------------------------------
  function banner(message) {
    const el = $("error-banner");
    el.textContent = message || "";
    el.hidden = !message;
  }

  /** Calls ``refresh`` now and every ``ms`` until stopped (never two at once); ``refresh`` returning false stops. */
  function poll(refresh, ms) {
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

  function decodeId(text) {
    try {
      return decodeURIComponent(text);
    } catch {
      return text; // not %-encoded as we write it: show it as typed
    }
  }

  function route() {
    if (current) current.stop();
    current = null;
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
    if (job) current = jobView(view, decodeId(job[1]));
    else if (hash === "#/nodes") current = nodesView(view);
    else current = jobsView(view);
  }

  // -- #/jobs --------------------------------------------------------------------------------------------------
  function restartsText(r) {
    return `${r.failure} failure · ${r.membership} membership · ${r.in_place} in-place`;
  }

  function jobsView(view) {
    document.title = "Jobs · etrain";
    const counts = h("p", { id: "job-counts", class: "muted" });
    const body = h("tbody");
    const table = h(
      "table",
      { id: "jobs-table", class: "grid" },
      h("thead", {}, h("tr", {}, ["Job", "State", "World size", "Progress", "Restarts", "Created", "Message"].map((c) => h("th", {}, c)))),
      body,
    );
    const empty = h("p", { id: "jobs-empty", class: "muted", hidden: true }, "No jobs. Submit one with ", h("code", {}, "etrain submit JOB.yaml"), " or POST /v1/jobs.");
    view.append(h("h1", {}, "Jobs"), counts, table, empty);
    return poll(async () => {
      const jobs = (await allJobs()).reverse(); // newest first
      const byState = {};
      for (const j of jobs) byState[j.state] = (byState[j.state] || 0) + 1;
      put(counts,
        `${jobs.length} job(s)`,
        ...Object.entries(byState).map(([state, n]) => h("span", { class: "count" }, stateBadge(state), ` ${n}`)),
      );
      empty.hidden = jobs.length > 0;
      table.hidden = jobs.length === 0;
      put(body,
        ...jobs.map((j) =>
          h(
            "tr",
            { "data-job-id": j.id, "data-state": j.state },
            h("td", {}, h("a", { href: jobHref(j.id) }, j.id)),
            h("td", {}, stateBadge(j.state)),
            h("td", { class: "num world-size" }, j.world_size === null ? "–" : `${j.world_size}`, j.nodes.length ? h("span", { class: "muted" }, ` on ${j.nodes.length} node(s)`) : null),
            h("td", { class: "step" }, progressBar(j.step, j.total_steps)),
            h("td", { class: "muted" }, restartsText(j.restarts)),
            h("td", { title: when(j.created_at) }, ago(j.created_at)),
            h("td", { class: "message" }, j.message),
          ),
        ),
      );
    }, POLL_MS.jobs);
  }

  // -- #/nodes -------------------------------------------------------------------------------------------------
  function nodesView(view) {
    document.title = "Nodes · etrain";
    const counts = h("p", { id: "node-counts", class: "muted" });
    const body = h("tbody");
    const table = h(
      "table",
      { id: "nodes-table", class: "grid" },
      h("thead", {}, h("tr", {}, ["Node", "Host", "Slots free / total", "Jobs", "Registered", "Lease TTL"].map((c) => h("th", {}, c)))),
      body,
    );
    const empty = h("p", { id: "nodes-empty", class: "muted", hidden: true }, "No live nodes: start agents with ", h("code", {}, "etrain agent"), ".");
    view.append(h("h1", {}, "Nodes"), counts, table, empty);
    return poll(async () => {
      const [nodes, jobs] = await Promise.all([api("v1/nodes"), allJobs()]);
      const states = Object.fromEntries(jobs.map((j) => [j.id, j.state]));
      const list = nodes.nodes;
      const live = list.filter((n) => n.live !== false); // the others are listed for a cordon / drain request
      const capacity = live.reduce((a, n) => a + n.capacity, 0);
      const free = live.reduce((a, n) => a + Math.max(0, n.free), 0);
      counts.textContent = `${live.length} live node(s), ${free} of ${capacity} worker slot(s) free`;
      empty.hidden = list.length > 0;
      table.hidden = list.length === 0;
      put(body,
        ...list.map((n) =>
          h(
            "tr",
            { "data-node": n.name },
            h(
              "td",
              {},
              h("strong", {}, n.name),
              n.mode && n.mode !== "active"
                ? h("span", { class: "muted node-mode", title: n.reason || "" }, ` ${n.mode}${n.live === false ? " (not live)" : ""}`)
                : null,
            ),
            h("td", {}, dash(n.hostname), n.rdzv_host && n.rdzv_host !== n.hostname ? h("span", { class: "muted" }, ` (rdzv ${n.rdzv_host})`) : null),
            h("td", { class: "num" }, `${n.free} / ${n.capacity}`),
            h(
              "td",
              { class: "node-jobs" },
              n.jobs.length
                ? n.jobs.map((id) => h("span", { class: "node-job" }, h("a", { href: jobHref(id) }, id), " ", states[id] ? stateBadge(states[id]) : null))
                : h("span", { class: "muted" }, "idle"),
            ),
            h("td", { title: when(n.registered_at) }, ago(n.registered_at)),
            h("td", { class: "num" }, n.lease_ttl ? `${n.lease_ttl} s` : "–"),
          ),
        ),
      );
    }, POLL_MS.nodes);
  }

  // -- #/jobs/<id> ---------------------------------------------------------------------------------------------
  /** A job's metric series as this page holds it: read from the job's first report when the page opens (the
   * controller keeps it: older reports as windows of [first, last, min, max]), then only the reports after the
   * newest one held (?since=). ``entries``: windows and points, oldest first, times in seconds. */
  function metricSeries(id) {
    const s = { entries: [], count: 0, loaded: false };
    const end = (e) => (e.n === undefined ? e.t : e.t_last);
    s.refresh = async () => {
      const last = s.loaded && s.entries.length ? end(s.entries[s.entries.length - 1]) : null;
      const since = last === null ? "" : `&since=${last}`;
      const body = await api(`v1/jobs/${encodeURIComponent(id)}/metrics?max_points=${MAX_SERIES}${since}`);
      const fresh = [...body.windows, ...body.points];
      if (last === null) s.entries = fresh;
      else s.entries.push(...fresh.filter((e) => (e.n === undefined ? e.t : e.t_first) > last));
      s.count = body.count;
      s.loaded = s.entries.length <= 2 * MAX_SERIES; // grown too long: read it again, fitted, next time
    };
    return s;
  }

  /** ``name``'s curve ([{t: ms, v}]): a point as it is, a window as its first, min, max and last value. */
  function curve(entries, name) {
    const out = [];
    for (const e of entries) {
      if (e.n === undefined) {
        if (e[name] !== null && e[name] !== undefined) out.push({ t: e.t * 1000, v: e[name] });
      } else if (e[name]) {
        const [first, last, lo, hi] = e[name];
        const a = e.t_first * 1000;
        const b = e.t_last * 1000;
        out.push({ t: a, v: first });
        if (b > a) out.push({ t: (a + b) / 2, v: lo }, { t: (a + b) / 2, v: hi }, { t: b, v: last });
      }
    }
    return out;
  }

  /** Where the world size changed, the job restarted (a new generation, or torchrun's in-place restarts) and
   * a snapshot was committed: [{t: ms, kind, text}], from the series (a window marks what changed within it). */
  function seriesMarks(entries) {
    const out = [];
    const at = (e) => (e.n === undefined ? e.t : (e.t_first + e.t_last) / 2) * 1000;
    const first = (e, k) => (e.n === undefined ? e[k] : e[k] ? e[k][0] : null);
    const last = (e, k) => (e.n === undefined ? e[k] : e[k] ? e[k][1] : null);
    const inside = (e, k) => e.n !== undefined && e[k] && e[k][2] !== e[k][3];
    const changed = (prev, e, k) => {
      const before = prev ? last(prev, k) : null;
      const now = first(e, k);
      return (before !== null && before !== undefined && now !== null && now !== undefined && now !== before) || inside(e, k);
    };
    let prev = null;
    for (const e of entries) {
      const t = at(e);
      if (changed(prev, e, "world_size")) out.push({ t, kind: "world_size", text: `world size ${prev ? last(prev, "world_size") : "?"} → ${last(e, "world_size")}` });
      if (changed(prev, e, "generation")) out.push({ t, kind: "restart", text: `restart: generation ${last(e, "generation")}` });
      else if (changed(prev, e, "restart_count") && last(e, "restart_count") > (prev ? last(prev, "restart_count") : 0)) out.push({ t, kind: "restart", text: "restart: workers restarted in place" });
      const ckpt = first(e, "checkpoint_step");
      const newCkpt = prev && ckpt !== null && ckpt !== undefined && ckpt !== last(prev, "checkpoint_step");
      if (newCkpt || inside(e, "checkpoint_step")) out.push({ t, kind: "snapshot", text: `snapshot committed at step ${last(e, "checkpoint_step")}` });
      prev = e;
    }
    return out.slice(-MAX_MARKS);
  }

  /** World size over time: the job's recorded history, then its metric series; each change once, and the
   * latest time seen last (the step function is held to it). */
  function worldSizes(job, sizes) {
    const points = job.world_size.history.map((c) => ({ t: new Date(c.at).getTime(), v: c.world_size }));
    points.push(...sizes);
    points.sort((a, b) => a.t - b.t);
    const changes = [];
    for (const p of points) if (!changes.length || changes[changes.length - 1].v !== p.v) changes.push(p);
    const end = points.length ? points[points.length - 1] : null;
    return { changes, points: end && end.t > changes[changes.length - 1].t ? [...changes, end] : changes };
  }

  function ticks(lo, hi, count, integer) {
    if (hi === lo) return [lo];
    const raw = (hi - lo) / count;
    const mag = 10 ** Math.floor(Math.log10(raw));
    let step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(Number(v.toPrecision(12)));
    return out;
  }

  /** A line chart of ``points`` ([{t: ms, v}]) as SVG; ``stepped``: a step function held to its last point;
   * ``span``: the time axis [t0, t1] (ms; default: the points'); ``marks``: [{t, kind, text}] drawn across it. */
  function lineChart(id, points, { stepped = false, integer = false, zero = false, note = "", values = null, span = null, marks = [] } = {}) {
    const W = 520;
    const H = 190;
    const L = 52;
    const R = 12;
    const T = 12;
    const B = 28;
    const root = svg("svg", {
      id,
      class: "chart",
      viewBox: `0 0 ${W} ${H}`,
      role: "img",
      "data-points": points.length,
      "data-values": (values || points.map((p) => p.v)).map((v) => num(v, 6)).join(","),
    });
    root.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "plot-bg" }));
    if (points.length === 0) {
      root.append(svg("text", { x: (L + W - R) / 2, y: H / 2, class: "chart-empty", "text-anchor": "middle" }, note || "no data yet"));
      return root;
    }
    const t0 = span ? Math.min(span[0], points[0].t) : points[0].t;
    const t1 = Math.max(span ? span[1] : 0, points[points.length - 1].t, t0 + 1000);
    let lo = Math.min(...points.map((p) => p.v));
    let hi = Math.max(...points.map((p) => p.v));
    if (zero) lo = Math.min(0, lo);
    if (hi === lo) {
      hi += integer ? 1 : Math.abs(hi) * 0.1 || 1;
      if (!zero) lo -= integer ? 1 : Math.abs(lo) * 0.1 || 1;
    }
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
    for (const v of ticks(lo, hi, 4, integer)) {
      root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid-line" }));
      root.append(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" }, num(v, 3)));
    }
    const width = t1 - t0;
    const shown = marks.filter((m) => m.t >= t0 && m.t <= t1);
    root.setAttribute("data-marks", shown.map((m) => m.kind).join(","));
    for (const m of shown) {
      root.append(svg("line", { x1: x(m.t), x2: x(m.t), y1: T, y2: H - B, class: `mark mark-${m.kind}` }, svg("title", {}, `${clock(m.t)}: ${m.text}`)));
    }
    for (let i = 0; i <= 3; i++) {
      const t = t0 + (width * i) / 3;
      const anchor = i === 0 ? "start" : i === 3 ? "end" : "middle";
      root.append(svg("text", { x: x(t), y: H - 8, "text-anchor": anchor, class: "tick" }, clock(t)));
    }
    let d = `M${x(points[0].t).toFixed(1)},${y(points[0].v).toFixed(1)}`;
    for (const p of points.slice(1)) {
      d += stepped ? `H${x(p.t).toFixed(1)}V${y(p.v).toFixed(1)}` : `L${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`;
    }
    if (stepped) d += `H${x(t1).toFixed(1)}`;
    root.append(svg("path", { d, class: "series" }));
    if (points.length <= 80) {
      for (const p of points) {
        root.append(svg("circle", { cx: x(p.t), cy: y(p.v), r: 2.5, class: "dot" }, svg("title", {}, `${clock(p.t)}: ${num(p.v)}`)));
      }
    }
    if (note) root.append(svg("text", { x: W - R - 4, y: T + 14, "text-anchor": "end", class: "chart-note" }, note));
    return root;
  }

  function section(title, id, ...children) {
    return h("section", { class: "card", id }, h("h2", {}, title), ...children);
  }

  function kv(pairs) {
    return h("dl", { class: "kv" }, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  }

  const DISRUPTIONS = {
    node_lost: "membership",
    node_joined: "membership",
    workers_failed: "failure",
    node_blacklisted: "failure",
  };

  function restartsPanel(job, events) {
    const r = job.restarts;
    const budget = job.restart_budget;
    const rows = [
      ["failure", r.failure, `generation restarts after failed workers (${budget.failures_left} of ${budget.max_failures} left)`],
      ["membership", r.membership, `nodes lost or added while running (${budget.membership_changes_left} of ${budget.max_membership_changes} left)`],
      ["in_place", r.in_place, "torchrun worker-group restarts within a generation"],
    ];
    const max = Math.max(1, ...rows.map((row) => row[1]));
    const bars = h(
      "table",
      { class: "bars", id: "restarts-table" },
      h(
        "tbody",
        {},
        rows.map(([cause, n, what]) => {
          const bar = h("span", { class: `bar-fill cause-${cause}` });
          bar.style.width = `${((100 * n) / max).toFixed(1)}%`;
          return h(
            "tr",
            { "data-cause": cause },
            h("th", {}, cause.replace("_", "-")),
            h("td", { class: "num count" }, String(n)),
            h("td", { class: "bar-cell" }, h("span", { class: "bar" }, bar)),
            h("td", { class: "muted" }, what),
          );
        }),
      ),
    );
    const causes = events.filter((e) => e.type in DISRUPTIONS);
    const recent = causes.slice(-8).reverse();
    return [
      bars,
      recent.length
        ? h(
            "ul",
            { class: "causes" },
            recent.map((e) => h("li", {}, h("span", { class: "muted" }, `${when(e.time)} `), h("code", {}, e.type), ` ${e.message}`)),
          )
        : h("p", { class: "muted" }, "No node losses, additions or worker failures recorded."),
    ];
  }

  /** A checkpoint's path below the job's prefix (``…/step-…``), else the path itself. */
  function below(path, prefix) {
    if (!path || !prefix) return dash(path);
    const bare = (u) => u.replace(/^file:\/\//, "").replace(/\/+$/, "");
    const [p, root] = [bare(path), bare(prefix)];
    return p.startsWith(`${root}/`) ? `…${p.slice(root.length)}` : path;
  }

  function checkpointsPanel(job, events) {
    const c = job.checkpoint;
    const commits = events.filter((e) => e.type === "checkpoint" || e.type === "checkpoint_rejected").reverse();
    const latest =
      c.step === null || c.step === undefined
        ? h("p", { id: "checkpoint-latest", class: "muted" }, "No committed checkpoint yet.")
        : h(
            "p",
            { id: "checkpoint-latest" },
            "Latest committed: ",
            h("strong", {}, `step ${c.step}`),
            ` at ${when(c.committed_at)}`,
            c.path ? [" — ", h("code", { title: c.path }, below(c.path, c.url))] : null,
          );
    const rows = commits.slice(0, 50).map((e) =>
      h(
        "tr",
        { class: e.type === "checkpoint_rejected" ? "rejected" : "" },
        h("td", { class: "nowrap" }, when(e.time)),
        h("td", { class: "num" }, e.type === "checkpoint" ? dash(e.data.step) : "rejected"),
        h("td", {}, h("code", { title: dash(e.data.path) }, below(e.data.path, c.url))),
      ),
    );
    const table = h(
      "table",
      { class: "grid compact", id: "checkpoints-table" },
      h("thead", {}, h("tr", {}, ["Committed", "Step", "Path"].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows),
    );
    return [
      kv([["prefix", c.url ? h("code", {}, c.url) : "–"]]),
      latest,
      commits.length ? h("div", { class: "scroll" }, table) : null,
      commits.length > rows.length ? h("p", { class: "muted" }, `${commits.length - rows.length} older commit(s) not shown.`) : null,
    ];
  }

  function eventsPanel(events) {
    const shown = events.slice(-300).reverse();
    const rows = shown.map((e) =>
      h("tr", { "data-type": e.type }, h("td", { class: "nowrap" }, when(e.time)), h("td", {}, h("code", {}, e.type)), h("td", {}, e.message)),
    );
    const table = h(
      "table",
      { class: "grid compact", id: "events-table" },
      h("thead", {}, h("tr", {}, ["Time", "Type", "Message"].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows),
    );
    return [
      h("div", { class: "scroll" }, table),
      events.length > shown.length ? h("p", { class: "muted" }, `${events.length - shown.length} older event(s) not shown.`) : null,
    ];
  }

  async function downloadTrace(id, status) {
    status.textContent = "downloading…";
    try {
      const resp = await call(`v1/jobs/${encodeURIComponent(id)}/trace`);
      const url = URL.createObjectURL(await resp.blob());
      const a = h("a", { href: url, download: `${id}.trace.json`, hidden: true });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 30000);
      status.textContent = `saved ${id}.trace.json`;
    } catch (err) {
      if (err instanceof AuthError) forgetToken(`Authentication failed: the controller refused the token (HTTP 401: ${err.message}).`);
      else status.textContent = `trace download failed: ${err.message}`;
    }
  }

  function jobView(view, id) {
    document.title = `${id} · etrain`;
    const series = metricSeries(id);
    let events = [];
    let lastEvent = null;
    const head = h("div", { id: "job-head" });
    const summary = h("div", { id: "job-summary" });
    const charts = h("div", { class: "charts" });
    const restarts = h("div");
    const checkpoints = h("div");
    const eventList = h("div");
    const traceStatus = h("span", { class: "muted", id: "trace-status" });
    const logsNote = h("p", { class: "muted", id: "logs-note" }, "loading…");
    const logsBox = h("pre", { class: "logs", id: "job-logs", hidden: true });
    let logsDone = false; // a finished job's logs do not change: read once
    const tracePath = `v1/jobs/${encodeURIComponent(id)}/trace`;
    const traceLink = h(
      "a",
      {
        id: "trace-link",
        href: apiUrl(tracePath).pathname,
        onclick: (event) => {
          event.preventDefault();
          downloadTrace(id, traceStatus);
        },
      },
      `/${tracePath}`,
    );
    view.append(
      h("p", { class: "crumbs" }, h("a", { href: "#/jobs" }, "Jobs"), " / ", id),
      head,
      summary,
      section(
        "Over time",
        "timeseries",
        h(
          "p",
          { class: "muted note", id: "series-note" },
          "From the job's first progress report: the controller keeps each job's series (the newest reports as they came, older ones downsampled, each stretch keeping its first, last, lowest and highest value), and this page adds the new reports as they arrive. Marks on the time axis: ",
          h("span", { class: "legend mark-world_size" }, "world-size change"),
          ", ",
          h("span", { class: "legend mark-restart" }, "restart"),
          ", ",
          h("span", { class: "legend mark-snapshot" }, "snapshot"),
          ".",
        ),
        charts,
      ),
      h("div", { class: "two" }, section("Restarts by cause", "restarts", restarts), section("Checkpoints", "checkpoints", checkpoints)),
      section("Events", "events", eventList),
      section("Logs", "logs", logsNote, logsBox),
      section(
        "Trace",
        "trace",
        h("p", {}, "The job's history as a Chrome trace (open it in Perfetto or chrome://tracing): ", traceLink, " "),
        traceStatus,
      ),
    );

    async function fetchLogs(job) {
      if (logsDone) return;
      if (!job.generation) {
        logsNote.textContent = "No logs yet: the job has not run on a node.";
        return;
      }
      let text;
      try {
        text = await (await call(`v1/jobs/${encodeURIComponent(id)}/logs?tail=${LOG_TAIL_BYTES}`)).text();
      } catch (err) {
        if (err instanceof AuthError) throw err;
        logsNote.textContent = `Logs unavailable: ${err.message}`;
        if (err.status === 403) logsDone = true; // a read token: logs need an admin token, asking again cannot help
        return;
      }
      // each node's section ("==> node (generation G) <==" and its lines) keeps its share of the lines shown
      const sections = [];
      for (const line of text.replace(/\n$/, "").split("\n")) {
        if (!sections.length || (line.startsWith("==> ") && line.endsWith(" <=="))) sections.push([]);
        sections[sections.length - 1].push(line);
      }
      const share = Math.max(20, Math.floor(LOG_LINES / sections.length));
      const lines = sections.flatMap((part) => (part.length > share ? [part[0], "…", ...part.slice(1 - share)] : part));
      const atEnd = logsBox.hidden || logsBox.scrollTop + logsBox.clientHeight >= logsBox.scrollHeight - 4;
      logsBox.textContent = lines.join("\n"); // text, never markup
      logsBox.hidden = false;
      if (atEnd) logsBox.scrollTop = logsBox.scrollHeight;
      logsNote.textContent = `The last lines of generation ${job.generation}'s logs, up to ${share} of each node's. Follow them live: etrain logs ${id} -f`;
      logsDone = ["succeeded", "failed", "cancelled"].includes(job.state);
    }

    async function fetchEvents() {
      for (let page = 0; page < 20; page++) {
        const after = lastEvent ? `&after=${encodeURIComponent(lastEvent)}` : "";
        const body = await api(`v1/jobs/${encodeURIComponent(id)}/events?limit=1000${after}`);
        events = events.concat(body.events);
        if (body.events.length) lastEvent = body.events[body.events.length - 1].id;
        if (body.events.length < 1000) break;
      }
    }

    return poll(async () => {
      let job;
      try {
        job = await api(`v1/jobs/${encodeURIComponent(id)}`);
      } catch (err) {
        if (err.status === 404) {
          put(head, h("h1", {}, id), h("p", { class: "error", id: "job-missing" }, `No job ${id}: it never existed, or it ended and was deleted after the retention period.`));
          return false;
        }
        throw err;
      }
      await fetchEvents();
      await fetchLogs(job);
      await series.refresh();

      const p = job.progress;

      put(head,
        h("h1", {}, id, " ", stateBadge(job.state)),
        h("p", { class: "message", id: "job-message" }, job.message, job.cancel_requested ? " (cancel requested)" : ""),
        job.last_error ? h("pre", { class: "error", id: "job-error" }, job.last_error) : null,
      );
      const ws = job.world_size;
      put(summary,
        h(
          "div",
          { class: "stats" },
          h("div", { class: "stat" }, h("span", { class: "label" }, "world size"), h("span", { class: "value", id: "world-size-current" }, dash(ws.current)), h("span", { class: "muted" }, ws.expected !== null ? `expected ${ws.expected}` : "no nodes assigned")),
          h("div", { class: "stat" }, h("span", { class: "label" }, "step"), h("span", { class: "value", id: "job-step" }, p.total_steps ? `${dash(p.step)} / ${p.total_steps}` : dash(p.step)), progressBar(p.step, p.total_steps)),
          h("div", { class: "stat" }, h("span", { class: "label" }, "loss"), h("span", { class: "value", id: "job-loss" }, num(p.loss)), h("span", { class: "muted" }, p.updated_at ? `reported ${ago(p.updated_at)}` : "no report yet")),
          h("div", { class: "stat" }, h("span", { class: "label" }, "generation"), h("span", { class: "value" }, String(job.generation)), h("span", { class: "muted" }, `${job.restarts.failure + job.restarts.membership + job.restarts.in_place} restart(s)`)),
        ),
        kv([
          ["nodes", job.nodes.length ? h("span", { id: "job-nodes" }, job.nodes.map((n, i) => [i ? ", " : "", h("a", { href: "#/nodes" }, n)])) : "none"],
          ["spec", `${job.spec.min_nodes}..${job.spec.max_nodes} node(s) × ${job.spec.nproc_per_node} worker(s), recovery ${job.spec.recovery}, ${job.spec.entrypoint}`],
          ["submitted", `${when(job.created_at)} by ${dash(job.submitted_by)}`],
          ["started / finished", `${when(job.started_at)} / ${when(job.finished_at)}`],
          ["backoff until", when(job.backoff_until)],
          ["blacklist", Object.keys(job.blacklist).length ? Object.entries(job.blacklist).map(([n, until]) => `${n} until ${when(until)}`).join(", ") : "none"],
        ]),
      );

      const entries = series.entries;
      const losses = curve(entries, "loss");
      const rate = curve(entries, "steps_per_s");
      const sizes = worldSizes(job, curve(entries, "world_size"));
      const marks = seriesMarks(entries);
      const times = [...sizes.points, ...losses, ...rate].map((q) => q.t);
      const span = times.length ? [Math.min(...times), Math.max(...times)] : null;
      const collecting = `${series.count} report(s) so far`;
      charts.setAttribute("data-reports", String(series.count));
      charts.setAttribute("data-first", entries.length ? String(entries[0].n === undefined ? entries[0].t : entries[0].t_first) : "");
      put(charts,
        h("figure", { id: "chart-loss" }, h("figcaption", {}, "Loss"), lineChart("svg-loss", losses, { note: losses.length < 2 ? collecting : "", span, marks })),
        h("figure", { id: "chart-rate" }, h("figcaption", {}, "Steps / s"), lineChart("svg-rate", rate, { zero: true, note: rate.length < 2 ? collecting : "", span, marks })),
        h(
          "figure",
          { id: "chart-world-size" },
          h("figcaption", {}, "World size", h("span", { class: "muted", id: "world-size-changes" }, sizes.changes.length ? ` (${sizes.changes.map((c) => c.v).join(" → ")})` : "")),
          lineChart("svg-world-size", sizes.points, { stepped: true, integer: true, zero: true, values: sizes.changes.map((c) => c.v), span, marks }),
        ),
      );
      put(restarts, ...restartsPanel(job, events));
      put(checkpoints, ...checkpointsPanel(job, events));
      put(eventList, ...eventsPanel(events));
      return true;
    }, POLL_MS.job);
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
})();
