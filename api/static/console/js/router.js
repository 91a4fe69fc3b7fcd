// Hash routes: #/jobs, #/jobs/<id>, #/files, #/files/<id>, #/models, #/chat, #/quotas. A route shows
// the sections whose data-view names it (sections without data-view, the key, always show) and is
// announced on the bus as "route" ({view, id}).

import { $ } from "./dom.js";

const VIEWS = new Set(["jobs", "files", "models", "chat", "quotas"]);

/** The route of ``hash``: {view, id} (id null on a list view); an unknown hash is the jobs list. */
export function parseRoute(hash) {
  const [name, ...rest] = hash.replace(/^#\/?/, "").split("/");
  const id = rest.length ? decodeURIComponent(rest.join("/")) : null;
  if (!VIEWS.has(name)) return { view: "jobs", nav: "jobs", id: null };
  if (name === "jobs" && id) return { view: "job", nav: "jobs", id };
  if (name === "files" && id) return { view: "file", nav: "files", id };
  return { view: name, nav: name, id: null };
}

/** The hash of a view (``id``: one job or file). */
export function href(name, id) {
  return id ? `#/${name}/${encodeURIComponent(id)}` : `#/${name}`;
}

export function go(name, id) {
  const target = href(name, id);
  if (window.location.hash !== target) window.location.hash = target;
}

export function initRouter(bus) {
  let current = null;
  function show() {
    const route = parseRoute(window.location.hash);
    for (const section of document.querySelectorAll("section[data-view]")) {
      section.hidden = section.dataset.view !== route.view;
    }
    for (const link of document.querySelectorAll("nav [data-nav]")) {
      if (link.dataset.nav === route.nav) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    document.body.dataset.view = route.view;
    current = route;
    bus.dispatchEvent(new CustomEvent("route", { detail: route }));
  }
  window.addEventListener("hashchange", show);
  return {
    start: show,
    get current() { return current; },
  };
}

/** Ask before something cannot be undone: the page's <dialog>; resolves true when confirmed. */
export function confirmAction(text, action = "Delete") {
  const dialog = $("#confirm-dialog");
  $("#confirm-text").textContent = text;
  $("#confirm-ok").textContent = action;
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
  });
}
