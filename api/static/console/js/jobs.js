// A new job (the create form) and the team's jobs (follow one).

import { api, apiJson } from "./api.js";
import { $, h, setChildren, when } from "./dom.js";
import { markField, showError, showInfo } from "./errors.js";
import { BASE_FIRST, fillModelSelect } from "./models.js";

/** The request body of POST /v1/fine_tuning/jobs from the form; blank fields are left out. */
function jobBody(form) {
  const field = (name) => form.elements.namedItem(name).value.trim();
  const body = { model: field("model"), training_file: field("training_file") };
  if (field("validation_file")) body.validation_file = field("validation_file");
  if (field("suffix")) body.suffix = field("suffix");
  if (field("seed")) body.seed = Number.parseInt(field("seed"), 10);
  const nested = { hyperparameters: {}, engine: {} };
  for (const el of form.elements) {
    const [root, ...path] = (el.name || "").split(".");
    if (!(root in nested) || el.value.trim() === "") continue;
    const kind = el.dataset.kind;
    const value = kind === "int" ? Number.parseInt(el.value, 10) : kind === "float" ? Number(el.value) : el.value;
    let target = nested[root];
    for (const key of path.slice(0, -1)) target = target[key] ??= {};
    target[path[path.length - 1]] = value;
  }
  for (const [root, value] of Object.entries(nested)) if (Object.keys(value).length) body[root] = value;
  return body;
}

function fileOptions(select, files, blank) {
  const keep = select.value;
  const usable = files.filter((f) => f.purpose === "fine-tune");
  setChildren(select,
    blank === null ? [] : h("option", { value: "" }, blank),
    usable.map((f) => h("option", { value: f.id }, `${f.filename} (${f.id}, ${f.num_examples ?? "?"} examples)`)));
  if (keep && usable.some((f) => f.id === keep)) select.value = keep;
}

export function initJobs(bus) {
  const form = $("#job-form");
  const result = $("#job-form-result");
  const tbody = $("#jobs-table tbody");

  async function refresh() {
    try {
      const page = await apiJson("/fine_tuning/jobs", { query: { limit: 20 } });
      setChildren(tbody, page.data.map((j) => h("tr", {},
        h("td", { class: "id" }, j.id), h("td", { class: "mono" }, j.model),
        h("td", { class: `status-${j.status}` }, j.status), h("td", {}, when(j.created_at)),
        h("td", { class: "id" }, j.fine_tuned_model ?? ""),
        h("td", {}, h("button", {
          type: "button", "aria-label": `Follow job ${j.id}`,
          onclick: () => bus.dispatchEvent(new CustomEvent("follow", { detail: j.id })),
        }, "Follow")))));
    } catch (err) {
      showError(result, err);
    }
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    markField(form, null);
    try {
      const job = await (await api("/fine_tuning/jobs", { method: "POST", json: jobBody(form) })).json();
      showInfo(result, "Created ", h("span", { class: "mono" }, job.id), ` (${job.status}).`);
      await refresh();
      bus.dispatchEvent(new CustomEvent("follow", { detail: job.id }));
    } catch (err) {
      showError(result, err);
      markField(form, err.param);
    } finally {
      button.disabled = false;
    }
  });
  $("#refresh-jobs").addEventListener("click", refresh);
  bus.addEventListener("key", refresh);
  bus.addEventListener("job-finished", refresh);
  bus.addEventListener("models", (e) => fillModelSelect($("#job-model"), e.detail, { order: BASE_FIRST }));
  bus.addEventListener("files", (e) => {
    fileOptions($("#job-training-file"), e.detail, null);
    fileOptions($("#job-validation-file"), e.detail, "none");
  });
}
