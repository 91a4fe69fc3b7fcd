// The models view (#/models): every model the team may name, its kind and whether it can be used
// (``usable: false``: e.g. a broken base folder), and delete for the team's own models and
// checkpoints (DELETE /v1/models/{id}, after confirming).

import { api, getKey, seg } from "./api.js";
import { $, h, setChildren, when } from "./dom.js";
import { showError, showInfo } from "./errors.js";
import { loadModels, usable } from "./models.js";
import { confirmAction } from "./router.js";

const DELETABLE = new Set(["fine-tuned", "checkpoint"]);

export function initCatalog(bus) {
  const status = $("#models-status");
  const tbody = $("#models-table tbody");

  function render(models) {
    setChildren(tbody, [...models].sort((a, b) => b.created - a.created).map((m) => h("tr", { "data-model": m.id },
      h("td", { class: "id" }, m.id), h("td", {}, m.kind ?? ""), h("td", {}, m.owned_by ?? ""),
      h("td", {}, when(m.created)),
      h("td", { class: usable(m) ? "ok" : "error" }, usable(m) ? "yes" : `no${m.unusable_reason ? `: ${m.unusable_reason}` : ""}`),
      h("td", { class: "actions" },
        usable(m) ? h("button", { type: "button", "aria-label": `Chat with ${m.id}`,
          onclick: () => bus.dispatchEvent(new CustomEvent("chat-model", { detail: m.id })) }, "Chat") : "",
        " ",
        DELETABLE.has(m.kind) ? h("button", { type: "button", class: "danger", "aria-label": `Delete model ${m.id}`,
          onclick: () => remove(m.id) }, "Delete") : ""))));
  }

  async function reload() {
    try {
      bus.dispatchEvent(new CustomEvent("models", { detail: await loadModels() }));
    } catch (err) {
      showError(status, err);
    }
  }

  async function remove(id) {
    if (!await confirmAction(`Delete the model ${id}? Its files are removed from the server and its id stops working.`)) {
      return;
    }
    try {
      await api(`/models/${seg(id)}`, { method: "DELETE" });
      showInfo(status, `Deleted ${id}.`);
      await reload();
    } catch (err) {
      showError(status, err);
    }
  }

  $("#refresh-models").addEventListener("click", reload);
  bus.addEventListener("models", (e) => render(e.detail));
  bus.addEventListener("route", (e) => { if (e.detail.view === "models" && getKey()) reload(); });
}
