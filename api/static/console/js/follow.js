// One job's view (#/jobs/<id>), followed live: its object (hyperparameters as resolved, data, duration
// and estimated finish), its plan and data check (from its events), metrics charts (smoothing, log
// scale), checkpoints (download, chat, delete) and its events as the server streams them (SSE over
// fetch, resumed after the last event id when the stream drops), filtered by level.

import { api, apiJson, getKey, seg, serverEvents } from "./api.js";
import { MetricCharts } from "./charts.js";
import { $, duration, h, num, setChildren, when } from "./dom.js";
import { downloadModel } from "./download.js";
import { showError, showInfo } from "./errors.js";
import { planView } from "./plan.js";
import { confirmAction, go, href } from "./router.js";
import { METHOD_NAMES, jobMethod, runName } from "./runs.js";

/** A hyperparameter's value as text (objects as compact JSON, null as "none"). */
function show(value) {
  if (value === null || value === undefined) return "none";
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function kvRows(tbody, entries) {
  setChildren(tbody, entries.map(([k, v]) => h("tr", {}, h("th", { scope: "row" }, k),
    h("td", { class: "mono" }, v instanceof Node ? v : show(v)))));
}

const LEVELS = { all: ["info", "warn", "error"], warn: ["warn", "error"], error: ["error"] };

const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
/** What a pause applies to (a paused job is resumed instead). */
const PAUSABLE = new Set(["validating_files", "queued", "running"]);
const MAX_LOG_LINES = 500;
const REFRESH_MS = 1000;
const RECONNECT_MS = 2000;

const sleep = (ms) => new Promise((resolve) => { setTimeout(resolve, ms); });

export function initFollow(bus) {
  const downloadStatus = $("#download-status");
  let current = null;

  function stop() {
    if (!current) return;
    current.ctl.abort();
    clearTimeout(current.timer);
    current.charts.destroy();
    current = null;
  }

  function renderJob(job) {
    setChildren($("#job-id"), job.id);
    setChildren($("#job-name"), runName(job));
    setChildren($("#job-method-name"), METHOD_NAMES[jobMethod(job)], job.hyperparameters?.lora ? " with a LoRA adapter" : "",
      jobMethod(job) === "reinforcement" && job.method?.reinforcement?.grader?.name
        ? ` (grader ${job.method.reinforcement.grader.name})` : "");
    const status = $("#job-status");
    status.className = `status-${job.status}`;
    setChildren(status, job.status, job.cancel_requested && !TERMINAL.has(job.status) ? " (cancel requested)" : "",
      job.pause_requested && job.status === "running" ? " (pause requested)" : "",
      job.queue_position ? ` (position ${job.queue_position} in the queue)` : "");
    const { step = 0, total_steps: total = 0 } = job.progress ?? {};
    const bar = $("#job-progress");
    bar.max = total || 1;
    bar.value = Math.min(step, total || 1);
    setChildren($("#job-progress-text"), total ? `step ${step} of ${total}` : "");
    setChildren($("#job-base-model"), h("code", {}, job.model));
    setChildren($("#job-result-model"), job.fine_tuned_model ? h("code", {}, job.fine_tuned_model) : "");
    setChildren($("#job-tokens"), job.trained_tokens ?? "");
    const error = $("#job-error");
    const { message = "", code = null, param = null } = job.error ?? {};
    setChildren(error, message, code ? ` (code ${code}${param ? `, field ${param}` : ""})` : "");
    error.className = "error";
    const done = job.status === "succeeded" && Boolean(job.fine_tuned_model);
    $("#cancel-job").disabled = TERMINAL.has(job.status);
    $("#pause-job").hidden = !PAUSABLE.has(job.status);
    $("#pause-job").disabled = Boolean(job.pause_requested || job.cancel_requested);
    $("#resume-job").hidden = job.status !== "paused";
    $("#download-model").hidden = !done;
    $("#download-adapter").hidden = !(done && job.hyperparameters?.lora);
    $("#chat-with-job").hidden = !done;
    $("#compare-with-base").hidden = !done;
    setChildren($("#job-created"), when(job.created_at));
    const end = job.finished_at ?? (TERMINAL.has(job.status) ? null : Date.now() / 1000);
    setChildren($("#job-duration"), end ? `${duration(end - job.created_at)}${job.finished_at ? "" : " so far"}` : "");
    const eta = job.estimated_finish;
    setChildren($("#job-eta"), TERMINAL.has(job.status) ? "finished" : job.status === "paused" ? "paused"
      : eta ? `${when(eta)} (in ${duration(Math.max(0, eta - Date.now() / 1000))})` : "not estimated yet");
    const hp = job.hyperparameters ?? {};
    kvRows($("#job-hyperparameters tbody"), [
      ...Object.entries(hp),
      ...Object.entries(job.engine ?? {}).map(([k, v]) => [`engine.${k}`, v]),
      ["resources.gpus", job.resources?.gpus ?? 1],
      ...[["seed", job.seed], ["suffix", job.suffix]].filter(([k]) => !(k in hp)),
    ]);
    const fileLink = (id) => (id ? h("a", { href: href("files", id) }, id) : "none");
    const data = [
      ["training_file", fileLink(job.training_file)],
      ["validation_file", fileLink(job.validation_file)],
      ["steps_per_epoch", hp.steps_per_epoch],
      ["total_steps", hp.total_steps ?? job.progress?.total_steps],
      ["trained_tokens", job.trained_tokens],
    ];
    if (current?.dataCheck) data.push(["data check", current.dataCheck]);
    kvRows($("#job-data tbody"), data.filter(([, v]) => v !== undefined));
  }

  /** What an event tells the view besides the log: the plan, the data check. */
  function noteEvent(state, ev) {
    if (ev.data?.plan) setChildren($("#job-plan"), planView(ev.message, ev.data.plan));
    if (ev.data?.errors?.length) {  // a data error ends the run: its lines' problems
      showError($("#job-data-errors"), { message: ev.message, errors: ev.data.errors });
    }
    if (/^Validated (training|validation) file/.test(ev.message)) {
      state.dataCheck = state.dataCheck ? `${state.dataCheck}; ${ev.message}` : ev.message;
      if (state.job) renderJob(state.job);
    }
  }

  function renderCheckpoints(checkpoints) {
    setChildren($("#checkpoints-table tbody"), checkpoints.map((c) => {
      const id = c.fine_tuned_model_checkpoint;
      return h("tr", {},
        h("td", {}, c.step_number), h("td", {}, num(c.metrics?.train_loss)), h("td", {}, num(c.metrics?.valid_loss)),
        h("td", { class: "id" }, id),
        h("td", { class: "actions" },
          h("button", { type: "button", "aria-label": `Download checkpoint at step ${c.step_number}`,
            onclick: () => downloadModel(id, downloadStatus) }, "Download"), " ",
          h("button", { type: "button", "aria-label": `Chat with checkpoint at step ${c.step_number}`,
            onclick: () => bus.dispatchEvent(new CustomEvent("chat-model", { detail: id })) }, "Chat"), " ",
          h("button", { type: "button", class: "danger", "aria-label": `Delete checkpoint at step ${c.step_number}`,
            onclick: () => deleteCheckpoint(id) }, "Delete")));
    }));
  }

  async function deleteCheckpoint(id) {
    if (!await confirmAction(`Delete the checkpoint ${id}? Its files are removed from the server.`)) return;
    try {
      await api(`/models/${seg(id)}`, { method: "DELETE" });
      showInfo(downloadStatus, `Deleted ${id}.`);
      if (current) await refresh(current);
      bus.dispatchEvent(new CustomEvent("job-finished", { detail: current?.job }));  // models reload
    } catch (err) {
      showError(downloadStatus, err);
    }
  }

  /** Whether ``ev`` passes the level and step filters. */
  function shown(ev) {
    const level = $("#events-level").value;
    if (!LEVELS[level].includes(ev.level)) return false;
    return $("#events-steps").checked || ev.type !== "metrics";
  }

  function renderEvents(state) {
    const log = $("#events-log");
    const visible = state.events.filter(shown).slice(-MAX_LOG_LINES);
    setChildren(log, visible.map(eventItem));
    setChildren($("#events-count"), `${visible.length} of ${state.events.length} events shown`);
    log.scrollTop = log.scrollHeight;
  }

  function eventItem(ev) {
    return h("li", { class: `level-${ev.level}`, "data-type": ev.type ?? "message" },
      `${new Date(ev.created_at * 1000).toLocaleTimeString()} `, `${ev.level} ${ev.message}`);
  }

  function addEvent(state, ev) {
    state.events.push(ev);
    if (state.events.length > 5 * MAX_LOG_LINES) state.events.splice(0, state.events.length - 5 * MAX_LOG_LINES);
    noteEvent(state, ev);
    const log = $("#events-log");
    if (shown(ev)) {
      log.append(eventItem(ev));
      while (log.childElementCount > MAX_LOG_LINES) log.firstElementChild.remove();
      log.scrollTop = log.scrollHeight;
    }
    setChildren($("#events-count"), `${log.childElementCount} of ${state.events.length} events shown`);
  }

  async function refresh(state) {
    try {
      const path = `/fine_tuning/jobs/${seg(state.id)}`;
      state.job = await apiJson(path);
      if (state !== current) return;
      renderJob(state.job);
      state.charts.setMethod(jobMethod(state.job));
      for (;;) {
        const page = await apiJson(`${path}/metrics`, { query: { after: state.charts.lastStep || undefined } });
        if (state !== current) return;
        state.charts.add(page.data);
        if (!page.has_more || page.data.length === 0) break;
      }
      renderCheckpoints((await apiJson(`${path}/checkpoints`, { query: { limit: 100 } })).data);
    } catch (err) {
      if (state === current) showError($("#job-error"), err);
    }
  }

  function scheduleRefresh(state) {
    if (state.timer) return;
    state.timer = setTimeout(() => { state.timer = null; refresh(state); }, REFRESH_MS);
  }

  async function streamEvents(state) {
    const status = $("#events-status");
    while (!state.ctl.signal.aborted) {
      try {
        const response = await api(`/fine_tuning/jobs/${seg(state.id)}/events`, {
          query: { stream: "true", after: state.lastEventId }, headers: { Accept: "text/event-stream" },
          signal: state.ctl.signal,
        });
        setChildren(status, "Following events live.");
        for await (const ev of serverEvents(response)) {
          if (ev.data === "[DONE]") {
            clearTimeout(state.timer);
            state.timer = null;
            await refresh(state);
            setChildren(status, "The job has finished.");
            bus.dispatchEvent(new CustomEvent("job-finished", { detail: state.job }));
            return;
          }
          const data = JSON.parse(ev.data);
          if (ev.event === "error" || data.error) throw new Error(data.error?.message ?? "stream error");
          state.lastEventId = ev.id ?? state.lastEventId;
          addEvent(state, data);
          scheduleRefresh(state);
        }
      } catch (err) {
        if (state.ctl.signal.aborted) return;
        setChildren(status, `The event stream was interrupted (${err.message}); reconnecting.`);
        if (err.status && err.status < 500 && err.status !== 429) return;  // 404, 401: no point retrying
      }
      await sleep(RECONNECT_MS);
    }
  }

  async function follow(id) {
    stop();
    for (const sel of ["#events-log", "#events-status", "#events-count", "#download-status", "#job-error",
      "#checkpoints-table tbody", "#job-hyperparameters tbody", "#job-data tbody", "#job-status",
      "#job-base-model", "#job-result-model", "#job-tokens", "#job-progress-text", "#job-created", "#job-duration",
      "#job-eta", "#job-data-errors", "#job-name", "#job-method-name"]) setChildren($(sel));
    for (const sel of ["#download-model", "#download-adapter", "#chat-with-job", "#compare-with-base", "#pause-job",
      "#resume-job"]) $(sel).hidden = true;
    setChildren($("#job-plan"), h("p", { class: "hint" }, "No plan recorded yet."));
    setChildren($("#job-id"), id);
    const state = { id, ctl: new AbortController(), charts: new MetricCharts($("#charts")), job: null,
      lastEventId: null, timer: null, events: [], dataCheck: null };
    state.charts.smoothing = Number($("#chart-smoothing").value);
    if ($("#chart-log").checked) state.charts.setLog(true);
    current = state;
    await refresh(state);
    streamEvents(state);
  }

  for (const action of ["cancel", "pause", "resume"]) {
    $(`#${action}-job`).addEventListener("click", async () => {
      if (!current) return;
      try {
        renderJob(await apiJson(`/fine_tuning/jobs/${seg(current.id)}/${action}`, { method: "POST" }));
      } catch (err) {
        showError($("#job-error"), err);
      }
    });
  }
  $("#download-model").addEventListener("click", () => downloadModel(current.job.fine_tuned_model, downloadStatus));
  $("#download-adapter").addEventListener("click",
    () => downloadModel(current.job.fine_tuned_model, downloadStatus, { adapter: true }));
  $("#chat-with-job").addEventListener("click",
    () => bus.dispatchEvent(new CustomEvent("chat-model", { detail: current.job.fine_tuned_model })));
  $("#compare-with-base").addEventListener("click", () => bus.dispatchEvent(new CustomEvent("side-by-side",
    { detail: { left: current.job.model, right: current.job.fine_tuned_model } })));
  $("#chart-smoothing").addEventListener("input", (e) => {
    setChildren($("#chart-smoothing-value"), e.target.value);
    current?.charts.setSmoothing(Number(e.target.value));
  });
  $("#chart-log").addEventListener("change", (e) => current?.charts.setLog(e.target.checked));
  $("#events-level").addEventListener("change", () => current && renderEvents(current));
  $("#events-steps").addEventListener("change", () => current && renderEvents(current));
  // The elapsed time of a running job moves on between events.
  setInterval(() => { if (current?.job && !TERMINAL.has(current.job.status)) renderJob(current.job); }, 5000);

  let route = null;
  bus.addEventListener("follow", (e) => go("jobs", e.detail));
  bus.addEventListener("route", (e) => {
    route = e.detail;
    if (route.view !== "job") stop();
    else if (current?.id !== route.id && getKey()) follow(route.id);
  });
  bus.addEventListener("key", () => {
    stop();
    if (route?.view === "job") follow(route.id);
  });
}
