// #/jobs: every job, newest first.
import { allJobs } from "./api.js";
import { ago, h, jobHref, progressBar, put, stateBadge, when } from "./dom.js";
import { poll, POLL_MS } from "./shell.js";

function restartsText(r) {
  return `${r.failure} failure · ${r.membership} membership · ${r.in_place} in-place`;
}

export function jobsView(view) {
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
