// Following one job live: its object, metrics charts, checkpoints (download, chat) and its events as
// the server streams them (SSE over fetch, resumed after the last event id when the stream drops).

import { api, apiJson, seg, serverEvents } from "./api.js";
import { MetricCharts } from "./charts.js";
import { $, h, num, setChildren } from "./dom.js";
import { downloadModel } from "./download.js";
import { showError } from "./errors.js";

const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const MAX_LOG_LINES = 500;
const REFRESH_MS = 1000;
const RECONNECT_MS = 2000;

const sleep = (ms) => new Promise((resolve) => { setTimeout(resolve, ms); });

export function initFollow(bus) {
  const section = $("#job-section");
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
    const status = $("#job-status");
    status.className = `status-${job.status}`;
    setChildren(status, job.status, job.cancel_requested && !TERMINAL.has(job.status) ? " (cancel requested)" : "",
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
    $("#download-model").hidden = !done;
    $("#download-adapter").hidden = !(done && job.hyperparameters?.lora);
    $("#chat-with-job").hidden = !done;
  }

  function renderCheckpoints(checkpoints) {
    setChildren($("#checkpoints-table tbody"), checkpoints.map((c) => {
      const id = c.fine_tuned_model_checkpoint;
      return h("tr", {},
        h("td", {}, c.step_number), h("td", {}, num(c.metrics?.train_loss)), h("td", {}, num(c.metrics?.valid_loss)),
        h("td", { class: "id" }, id),
        h("td", {},
          h("button", { type: "button", "aria-label": `Download checkpoint at step ${c.step_number}`,
            onclick: () => downloadModel(id, downloadStatus) }, "Download"), " ",
          h("button", { type: "button", "aria-label": `Chat with checkpoint at step ${c.step_number}`,
            onclick: () => bus.dispatchEvent(new CustomEvent("chat-model", { detail: id })) }, "Chat")));
    }));
  }

  function addEvent(ev) {
    const log = $("#events-log");
    log.append(h("li", { class: `level-${ev.level}` }, `${new Date(ev.created_at * 1000).toLocaleTimeString()} `,
      `${ev.level} ${ev.message}`));
    while (log.childElementCount > MAX_LOG_LINES) log.firstElementChild.remove();
    log.scrollTop = log.scrollHeight;
  }

  async function refresh(state) {
    try {
      const path = `/fine_tuning/jobs/${seg(state.id)}`;
      state.job = await apiJson(path);
      if (state !== current) return;
      renderJob(state.job);
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
          addEvent(data);
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
    section.hidden = false;
    setChildren($("#events-log"));
    setChildren($("#events-status"));
    setChildren($("#download-status"));
    setChildren($("#checkpoints-table tbody"));
    const state = { id, ctl: new AbortController(), charts: new MetricCharts($("#charts")), job: null,
      lastEventId: null, timer: null };
    current = state;
    await refresh(state);
    streamEvents(state);
  }

  $("#cancel-job").addEventListener("click", async () => {
    if (!current) return;
    try {
      renderJob(await apiJson(`/fine_tuning/jobs/${seg(current.id)}/cancel`, { method: "POST" }));
    } catch (err) {
      showError($("#job-error"), err);
    }
  });
  $("#download-model").addEventListener("click", () => downloadModel(current.job.fine_tuned_model, downloadStatus));
  $("#download-adapter").addEventListener("click",
    () => downloadModel(current.job.fine_tuned_model, downloadStatus, { adapter: true }));
  $("#chat-with-job").addEventListener("click",
    () => bus.dispatchEvent(new CustomEvent("chat-model", { detail: current.job.fine_tuned_model })));
  bus.addEventListener("follow", (e) => follow(e.detail));
  bus.addEventListener("key", () => { stop(); section.hidden = true; });
}
