// DOM helpers and formats of the etrain dashboard. Text is always a text node: nothing from the API is parsed
// as HTML.

const SVG_NS = "http://www.w3.org/2000/svg";

export const $ = (id) => document.getElementById(id);

export function fill(el, attrs, children) {
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
export const h = (tag, attrs, ...children) => fill(document.createElement(tag), attrs, children);
export const svg = (tag, attrs, ...children) => fill(document.createElementNS(SVG_NS, tag), attrs, children);
/** Replaces ``el``'s children (skipping null and false: replaceChildren would show them as text). */
export function put(el, ...children) {
  el.replaceChildren();
  return fill(el, {}, children);
}

export function pad(n) {
  return String(n).padStart(2, "0");
}
export function clock(ms) {
  const d = new Date(ms);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}
export function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${clock(d.getTime())}`;
}
export function ago(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
  return `${(s / 86400).toFixed(1)} d ago`;
}
export function num(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : String(Number(v.toPrecision(digits)));
}
export const dash = (v) => (v === null || v === undefined ? "–" : String(v));
export const jobHref = (id) => `#/jobs/${encodeURIComponent(id)}`;
export const stateBadge = (state) => h("span", { class: `state state-${state}` }, state);

export function progressBar(step, total) {
  const bar = h("span", { class: "bar-fill" });
  const pct = step !== null && step !== undefined && total ? Math.min(100, (100 * step) / total) : 0;
  bar.style.width = `${pct.toFixed(1)}%`; // CSSOM, not a style attribute: allowed by the CSP
  const text = step === null || step === undefined ? "–" : total ? `${step} / ${total}` : String(step);
  return h("span", { class: "progress" }, h("span", { class: "bar" }, bar), h("span", { class: "progress-text" }, text));
}

export function section(title, id, ...children) {
  return h("section", { class: "card", id }, h("h2", {}, title), ...children);
}

export function kv(pairs) {
  return h("dl", { class: "kv" }, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}
