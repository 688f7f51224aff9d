// #/nodes: the live nodes (and those listed for a cordon or drain request) and the jobs on each.
import { allJobs, api } from "./api.js";
import { ago, dash, h, jobHref, put, stateBadge, when } from "./dom.js";
import { poll, POLL_MS } from "./shell.js";

export function nodesView(view) {
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
