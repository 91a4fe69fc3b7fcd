// A new job (the create form) and the team's jobs: the runs table (open one, compare the curves of
// those ticked on one chart).

import { api, apiJson, getKey, seg } from "./api.js";
import { compareChart } from "./charts.js";
import { $, duration, h, setChildren, when } from "./dom.js";
import { markField, showError, showInfo } from "./errors.js";
import { BASE_FIRST, fillModelSelect } from "./models.js";
import { href } from "./router.js";

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

const METRIC_TITLES = { train_loss: "Train loss", valid_loss: "Validation loss", tokens_per_second: "Tokens per second" };

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

  const selected = new Set();
  const cache = new Map();  // job id -> metrics rows of a finished job
  let plot = null;

  async function refresh() {
    try {
      const page = await apiJson("/fine_tuning/jobs", { query: { limit: 50 } });
      const now = Date.now() / 1000;
      setChildren(tbody, page.data.map((j) => h("tr", { "data-job": j.id },
        h("td", {}, h("input", { type: "checkbox", "aria-label": `Compare job ${j.id}`, checked: selected.has(j.id),
          onchange: (e) => { if (e.target.checked) selected.add(j.id); else selected.delete(j.id); } })),
        h("td", { class: "id" }, h("a", { href: href("jobs", j.id) }, j.id)), h("td", { class: "mono" }, j.model),
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
        return { label: id, rows };
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
  bus.addEventListener("route", (e) => { if (e.detail.view === "jobs" && getKey()) refresh(); });
  bus.addEventListener("models", (e) => fillModelSelect($("#job-model"), e.detail, { order: BASE_FIRST }));
  bus.addEventListener("files", (e) => {
    fileOptions($("#job-training-file"), e.detail, null);
    fileOptions($("#job-validation-file"), e.detail, "none");
  });
}
