// The dashboard's charts, drawn here as SVG (no library): a job's metric series as curves, the marks on their
// time axis (world-size changes, restarts, snapshots) and the line chart.
import { clock, num, svg } from "./dom.js";

const MAX_MARKS = 200; // marks (world-size changes, restarts, snapshots) drawn on each chart's time axis

/** ``name``'s curve ([{t: ms, v}]): a point as it is, a window as its first, min, max and last value. */
export function curve(entries, name) {
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
export function seriesMarks(entries) {
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
export function worldSizes(job, sizes) {
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
export function lineChart(id, points, { stepped = false, integer = false, zero = false, note = "", values = null, span = null, marks = [] } = {}) {
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
