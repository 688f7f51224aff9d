// #/jobs/<id>: one job's page (its state, charts over time, restarts, checkpoints, events, logs and trace).
import { api, apiUrl, AuthError, call } from "./api.js";
import { curve, lineChart, seriesMarks, worldSizes } from "./charts.js";
import { ago, dash, h, kv, num, progressBar, put, section, stateBadge, when } from "./dom.js";
import { checkpointsPanel, eventsPanel, restartsPanel } from "./job-panels.js";
import { forgetToken, poll, POLL_MS } from "./shell.js";

const MAX_SERIES = 1500; // windows + points asked of GET /v1/jobs/{id}/metrics when a job's page opens
const LOG_LINES = 200; // the job page shows the last lines of the job's logs
const LOG_TAIL_BYTES = 32768; // asked of each node (GET /v1/jobs/{id}/logs?tail=)

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

export function jobView(view, id) {
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
