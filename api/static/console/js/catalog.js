// The models view (#/models): every model the team may name, grouped: each fine-tuned model with its
// checkpoints under it (a checkpoint whose job left no final model under its job's id), then the base
// models and built-in configs. Whether each can be used (``usable: false``: e.g. a broken base folder),
// download (GET /v1/models/{id}/content, checksum checked) and delete (DELETE /v1/models/{id}, after
// confirming) for the team's own.

import { api, getKey, seg } from "./api.js";
import { $, h, setChildren, when } from "./dom.js";
import { downloadModel } from "./download.js";
import { showError, showInfo } from "./errors.js";
import { loadModels, usable } from "./models.js";
import { confirmAction } from "./router.js";

const OWN = new Set(["fine-tuned", "checkpoint"]);
const CHECKPOINT = /^(.*):ckpt-step-(\d+)$/;
const KIND_HEADINGS = { base: "Base models", builtin: "Built-in configs (random weights, for smoke tests)" };

/** ``models`` as groups: [{id, heading, model, checkpoints: [{model, step}]}], the team's own first. */
export function groupModels(models) {
  const newest = (a, b) => b.created - a.created;
  const own = new Map();
  for (const m of models.filter((x) => x.kind === "fine-tuned").sort(newest)) {
    own.set(m.id, { id: m.id, model: m, checkpoints: [] });
  }
  for (const m of models.filter((x) => x.kind === "checkpoint")) {
    const [, parent = m.id, step = "0"] = CHECKPOINT.exec(m.id) ?? [];
    if (!own.has(parent)) own.set(parent, { id: parent, model: null, checkpoints: [] });
    own.get(parent).checkpoints.push({ model: m, step: Number(step) });
  }
  for (const g of own.values()) g.checkpoints.sort((a, b) => b.step - a.step);
  const groups = [...own.values()];
  for (const kind of ["base", "builtin"]) {
    const list = models.filter((m) => m.kind === kind).sort(newest);
    if (list.length) groups.push({ id: kind, heading: KIND_HEADINGS[kind], shared: list });
  }
  return groups;
}

export function initCatalog(bus) {
  const status = $("#models-status");
  const table = $("#models-table");

  function actions(m) {
    return h("td", { class: "actions" },
      usable(m) ? h("button", { type: "button", "aria-label": `Chat with ${m.id}`,
        onclick: () => bus.dispatchEvent(new CustomEvent("chat-model", { detail: m.id })) }, "Chat") : "",
      " ",
      OWN.has(m.kind) ? h("button", { type: "button", "aria-label": `Download model ${m.id}`,
        onclick: () => downloadModel(m.id, status) }, "Download") : "",
      " ",
      OWN.has(m.kind) ? h("button", { type: "button", class: "danger", "aria-label": `Delete model ${m.id}`,
        onclick: () => remove(m.id) }, "Delete") : "");
  }

  function row(m, { label = null, parent = null } = {}) {
    return h("tr", { "data-model": m.id, "data-parent": parent, class: parent ? "child" : null },
      h("td", { class: "id" }, label ? h("span", { class: "step" }, label) : null, label ? " " : null,
        h("span", { class: "mono" }, m.id),
        m.description && !parent ? h("span", { class: "description hint" }, m.description) : null),
      h("td", {}, m.kind ?? ""), h("td", {}, m.owned_by ?? ""), h("td", {}, when(m.created)),
      h("td", { class: usable(m) ? "ok" : "error" }, usable(m) ? "yes" : `no${m.unusable_reason ? `: ${m.unusable_reason}` : ""}`),
      actions(m));
  }

  function render(models) {
    const groups = groupModels(models);
    const head = table.tHead;
    setChildren(table, h("caption", { class: "sr-only" }, "Models your team may name"), head, groups.map((g) => {
      if (g.shared) {
        return h("tbody", { "data-group": g.id },
          h("tr", { class: "group" }, h("th", { scope: "rowgroup", colspan: 6 }, g.heading)),
          g.shared.map((m) => row(m)));
      }
      const heading = g.model ? null : h("tr", { class: "group", "data-model-group": g.id },
        h("th", { scope: "rowgroup", colspan: 6 }, h("span", { class: "mono" }, g.id),
          h("span", { class: "hint" }, " (no final model: the job ended before it; its checkpoints)")));
      return h("tbody", { "data-group": g.id, class: "own" },
        heading, g.model ? row(g.model) : null,
        g.checkpoints.map((c) => row(c.model, { label: `step ${c.step}`, parent: g.id })));
    }));
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
