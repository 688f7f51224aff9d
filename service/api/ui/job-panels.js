// The job page's panels that read its events: restarts by cause, checkpoints, the event list.
import { dash, h, kv, when } from "./dom.js";

const DISRUPTIONS = {
  node_lost: "membership",
  node_joined: "membership",
  workers_failed: "failure",
  node_blacklisted: "failure",
};

export function restartsPanel(job, events) {
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

export function checkpointsPanel(job, events) {
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

export function eventsPanel(events) {
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
