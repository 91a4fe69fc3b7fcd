// A new job (the create form: its method, the files of that method's kind, a reinforcement job's grader
// checked with the server first) and the team's jobs: the runs table (open one, compare the curves of
// those ticked on one chart).

import { api, apiJson, getKey, seg } from "./api.js";
import { compareChart } from "./charts.js";
import { $, duration, h, setChildren, when } from "./dom.js";
import { markField, showError, showInfo } from "./errors.js";
import { BASE_FIRST, fillModelSelect } from "./models.js";
import { href } from "./router.js";
import { METHOD_NAMES, jobMethod, runLabel, runName } from "./runs.js";

/** Every metrics row of a job (GET .../metrics pages by step). */
async function jobMetrics(id) {
  const rows = [];
  for (;;) {
    const page = await apiJson(`/fine_tuning/jobs/${seg(id)}/metrics`,
      { query: { after: rows.length ? rows[rows.length - 1].step : undefined } });
    rows.push(...page.data);
    if (!page.has_more || page.data.length === 0) return rows;
  }
}

const METRIC_TITLES = {
  train_loss: "Train loss", valid_loss: "Validation loss", tokens_per_second: "Tokens per second",
  reward_margin: "DPO reward margin", accuracy: "DPO preference accuracy", reward_mean: "Mean reward",
};

/** The file formats (the file object's ``format``) each method trains on. */
const METHOD_FORMATS = {
  supervised: ["chat", "prompt_completion"],
  dpo: ["preference"],
  reinforcement: ["reinforcement"],
};
const FORMAT_NAMES = {
  chat: "chat", prompt_completion: "prompt/completion", preference: "preference pairs",
  reinforcement: "prompts with item fields for the grader",
};

/** Whether a form control belongs to another method than ``method`` (its own or its fieldset's data-method). */
function otherMethod(el, method) {
  const owner = el.closest("[data-method]");
  return Boolean(owner && owner.dataset.method !== method);
}

/**
 * The request body of POST /v1/fine_tuning/jobs from the form; blank fields are left out. A supervised
 * job's hyperparameters go at the top level (as the openai SDK sends them); DPO's and reinforcement's in
 * ``method.<type>.hyperparameters``, with the reinforcement job's ``grader`` (already parsed).
 */
function jobBody(form, grader) {
  const field = (name) => form.elements.namedItem(name).value.trim();
  const method = field("method");
  const body = { model: field("model"), training_file: field("training_file") };
  if (field("validation_file")) body.validation_file = field("validation_file");
  if (field("suffix")) body.suffix = field("suffix");
  if (field("seed")) body.seed = Number.parseInt(field("seed"), 10);
  const nested = { hyperparameters: {}, engine: {} };
  for (const el of form.elements) {
    const [root, ...path] = (el.name || "").split(".");
    if (!(root in nested) || el.value.trim() === "" || otherMethod(el, method)) continue;
    const kind = el.dataset.kind;
    const value = kind === "int" ? Number.parseInt(el.value, 10) : kind === "float" ? Number(el.value) : el.value;
    let target = nested[root];
    for (const key of path.slice(0, -1)) target = target[key] ??= {};
    target[path[path.length - 1]] = value;
  }
  if (Object.keys(nested.engine).length) body.engine = nested.engine;
  const hp = nested.hyperparameters;
  if (method === "supervised") {
    if (Object.keys(hp).length) body.hyperparameters = hp;
    return body;
  }
  const own = Object.keys(hp).length ? { hyperparameters: hp } : {};
  body.method = { type: method, [method]: method === "reinforcement" ? { grader, ...own } : own };
  return body;
}

/** The fine-tune files as ``select``'s options for ``method``: its kind of file first, a file of another
 *  kind shown but disabled (never chosen). Only a file of the method's kind is chosen for the user. */
function fileOptions(select, files, blank, method) {
  const keep = select.value;
  const wanted = METHOD_FORMATS[method];
  const kindOf = (f) => (f.format ? (wanted.includes(f.format) ? 0 : 2) : 1);  // 1: format not known
  const usable = files.filter((f) => f.purpose === "fine-tune").sort((a, b) => kindOf(a) - kindOf(b));
  const label = (f) => `${f.filename} (${f.id}, ${f.num_examples ?? "?"} examples${
    f.format ? `, ${FORMAT_NAMES[f.format] ?? f.format}` : ", format not known"})`;
  const matching = usable.filter((f) => kindOf(f) === 0);
  const first = blank ?? (matching.length ? null : `no ${METHOD_NAMES[method]} file: upload one under Datasets`);
  setChildren(select,
    first === null ? [] : h("option", { value: "" }, first),
    usable.map((f) => h("option", { value: f.id, "data-format": f.format ?? "", disabled: kindOf(f) === 2 },
      kindOf(f) === 2 ? `${label(f)}: not for ${METHOD_NAMES[method]}` : label(f))));
  if (keep && usable.some((f) => f.id === keep && kindOf(f) < 2)) select.value = keep;
  else select.value = blank !== null || !matching.length ? "" : matching[0].id;
}

/** The grader field's JSON, checked by POST /v1/fine_tuning/alpha/graders/validate: the grader, or null
 *  with the problem shown by the field. */
async function checkedGrader(form) {
  const field = form.elements.namedItem("grader");
  let grader;
  try {
    grader = JSON.parse(field.value);
  } catch (exc) {
    markField(form, "grader", `Not JSON: ${exc.message}`);
    return null;
  }
  try {
    await apiJson("/fine_tuning/alpha/graders/validate", { method: "POST", json: { grader } });
    return grader;
  } catch (err) {
    markField(form, err.param?.startsWith("grader") ? err.param : "grader", err.message);
    return null;
  }
}

export function initJobs(bus) {
  const form = $("#job-form");
  const result = $("#job-form-result");
  const tbody = $("#jobs-table tbody");

  const selected = new Set();
  const cache = new Map();  // job id -> metrics rows of a finished job
  let plot = null;

  async function refresh() {
    try {
      const page = await apiJson("/fine_tuning/jobs", { query: { limit: 50 } });
      const now = Date.now() / 1000;
      setChildren(tbody, page.data.map((j) => h("tr", { "data-job": j.id, "data-label": runLabel(j) },
        h("td", {}, h("input", { type: "checkbox", "aria-label": `Compare job ${j.id}`, checked: selected.has(j.id),
          onchange: (e) => { if (e.target.checked) selected.add(j.id); else selected.delete(j.id); } })),
        h("td", { class: "id" }, h("a", { href: href("jobs", j.id) }, j.id)),
        h("td", { class: "run" }, h("strong", {}, runName(j)), h("br"),
          h("span", { class: "hint" }, METHOD_NAMES[jobMethod(j)], j.hyperparameters?.lora ? ", LoRA" : "")),
        h("td", { class: "mono" }, j.model),
        h("td", { class: `status-${j.status}` }, j.status), h("td", {}, when(j.created_at)),
        h("td", {}, j.finished_at ? duration(j.finished_at - j.created_at)
          : ["queued", "running", "paused", "validating_files"].includes(j.status) ? `${duration(now - j.created_at)} so far` : ""),
        h("td", { class: "id" }, j.fine_tuned_model ?? ""),
        h("td", {}, h("button", {
          type: "button", "aria-label": `Follow job ${j.id}`,
          onclick: () => bus.dispatchEvent(new CustomEvent("follow", { detail: j.id })),
        }, "Open")))));
      bus.dispatchEvent(new CustomEvent("jobs", { detail: page.data }));
    } catch (err) {
      showError(result, err);
    }
  }

  async function compare() {
    const status = $("#compare-status");
    const ids = [...selected];
    if (ids.length === 0) {
      showInfo(status, "Tick the jobs to compare first.");
      return;
    }
    showInfo(status, `Loading the metrics of ${ids.length} job${ids.length === 1 ? "" : "s"}...`);
    try {
      const runs = await Promise.all(ids.map(async (id) => {
        const row = tbody.querySelector(`tr[data-job="${CSS.escape(id)}"]`);
        const finished = row && /succeeded|failed|cancelled/.test(row.textContent);
        const rows = cache.get(id) ?? await jobMetrics(id);
        if (finished) cache.set(id, rows);
        return { label: row?.dataset.label ?? id, rows };
      }));
      const metric = $("#compare-metric").value;
      plot?.destroy();
      plot = compareChart($("#compare-chart"), runs, {
        metric, smoothing: Number($("#compare-smoothing").value), log: $("#compare-log").checked,
        title: `${METRIC_TITLES[metric]} by step`,
      });
      showInfo(status, `${METRIC_TITLES[metric]} of ${runs.map((r) => `${r.label} (${r.rows.length} steps)`).join(", ")}.`);
    } catch (err) {
      showError(status, err);
    }
  }
  $("#compare-runs").addEventListener("click", compare);
  for (const sel of ["#compare-metric", "#compare-smoothing", "#compare-log"]) {
    $(sel).addEventListener("change", () => { if (plot) compare(); });
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    markField(form, null);
    setChildren(result);
    try {
      let grader;
      if (form.elements.namedItem("method").value === "reinforcement") {
        showInfo(result, "Checking the grader...");
        grader = await checkedGrader(form);
        if (!grader) {
          showError(result, { message: "The grader was refused: see the message by the field.", param: "grader" });
          return;
        }
      }
      const job = await (await api("/fine_tuning/jobs", { method: "POST", json: jobBody(form, grader) })).json();
      showInfo(result, "Created ", h("span", { class: "mono" }, job.id), ` (${job.status}).`);
      await refresh();
      bus.dispatchEvent(new CustomEvent("follow", { detail: job.id }));
    } catch (err) {
      showError(result, err);
      markField(form, err.param, err.message);
    } finally {
      button.disabled = false;
    }
  });
  $("#refresh-jobs").addEventListener("click", refresh);
  bus.addEventListener("key", refresh);
  bus.addEventListener("job-finished", refresh);
  bus.addEventListener("route", (e) => { if (e.detail.view === "jobs" && getKey()) refresh(); });
  bus.addEventListener("models", (e) => fillModelSelect($("#job-model"), e.detail, { order: BASE_FIRST }));
  let files = [];
  function showMethod() {
    const method = form.elements.namedItem("method").value;
    for (const el of form.querySelectorAll("[data-method]")) el.hidden = el.dataset.method !== method;
    fileOptions($("#job-training-file"), files, null, method);
    fileOptions($("#job-validation-file"), files, "none", method);
    const kinds = METHOD_FORMATS[method].map((f) => FORMAT_NAMES[f]).join(" or ");
    setChildren($("#job-files-note"),
      `Files for a ${METHOD_NAMES[method]} job: ${kinds}. Files of another kind are listed but cannot be chosen.`);
  }
  form.elements.namedItem("method").addEventListener("change", () => {
    markField(form, null);
    showMethod();
  });
  bus.addEventListener("files", (e) => {
    files = e.detail;
    showMethod();
  });
  showMethod();
}
