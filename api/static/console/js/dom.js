// DOM helpers. Server text only ever becomes a Text node or an attribute value: never parsed as HTML.

/**
 * Create an element: h("td", {class: "id"}, text, child, ...). Attributes named on* add listeners;
 * null, undefined and false attributes and children are skipped.
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, ...children);
  return el;
}

/** Append children (nodes, or anything else as text). */
export function append(el, ...children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replace all children of ``el``. */
export function setChildren(el, ...children) {
  el.replaceChildren();
  return append(el, ...children);
}

export const $ = (selector, root = document) => root.querySelector(selector);

/** A unix time (seconds) as a local date and time. */
export function when(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleString() : "";
}

/** A number with ``digits`` significant digits, or an empty string for null. */
export function num(value, digits = 4) {
  if (value === null || value === undefined || Number.isNaN(value)) return "";
  return String(Number(Number(value).toPrecision(digits)));
}

/** Bytes as B / KiB / MiB / GiB. */
export function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

/** Seconds as "1 h 02 min", "3 min 05 s" or "12 s". */
export function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
  return `${s} s`;
}
