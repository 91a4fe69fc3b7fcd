// The models the team may name (GET /v1/models), as grouped <select> options.

import { apiJson } from "./api.js";
import { h, setChildren } from "./dom.js";

const LABELS = {
  "fine-tuned": "Your fine-tuned models",
  checkpoint: "Your checkpoints",
  base: "Base models",
  builtin: "Built-in configs",
};
/** Chat: the team's own models first. */
export const OWN_FIRST = ["fine-tuned", "checkpoint", "base", "builtin"];
/** A new job: starting points first. */
export const BASE_FIRST = ["base", "builtin", "fine-tuned", "checkpoint"];

/** A model the API marks unusable (``usable: false``, e.g. a broken base folder) is never offered. */
export const usable = (m) => m.usable !== false;

export async function loadModels() {
  return (await apiJson("/models")).data;
}

/**
 * Fill ``select`` with ``models`` grouped by kind in ``order`` (newest first within a group), keeping
 * the current choice when it is still there. ``blank``: a first option with value "" and that label.
 */
export function fillModelSelect(select, models, { blank = null, order = OWN_FIRST } = {}) {
  const keep = select.value;
  const options = [];
  if (blank !== null) options.push(h("option", { value: "" }, blank));
  for (const kind of order) {
    const group = models.filter((m) => m.kind === kind).sort((a, b) => b.created - a.created);
    if (group.length) {
      options.push(h("optgroup", { label: LABELS[kind] }, group.map((m) => h("option",
        { value: m.id, disabled: !usable(m) }, usable(m) ? m.id : `${m.id} (unusable)`))));
    }
  }
  setChildren(select, options);
  if (keep && models.some((m) => m.id === keep && usable(m))) select.value = keep;
  // Never leave an unusable model chosen (the browser's default is the first option, disabled or not).
  if (select.selectedOptions[0]?.disabled) {
    const first = [...select.options].find((o) => !o.disabled);
    select.value = first ? first.value : "";
  }
}
