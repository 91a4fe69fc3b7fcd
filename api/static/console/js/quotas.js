// The quotas view (#/quotas): GET /v1/quotas, each limit beside what the team uses (null: unlimited).

import { apiJson, getKey } from "./api.js";
import { $, bytes, h, num, setChildren } from "./dom.js";
import { showError } from "./errors.js";

const ROWS = [
  { limit: "max_running_jobs", usage: "running_jobs", label: "Running jobs", show: String },
  { limit: "max_queued_jobs", usage: "queued_jobs", label: "Queued jobs", show: String },
  { limit: "gpu_hours", usage: "gpu_hours", label: "GPU-hours", show: (v) => num(v, 4) },
  { limit: "storage_bytes", usage: "storage_bytes", label: "Storage", show: bytes },
];

export function initQuotas(bus) {
  const status = $("#quotas-status");

  async function refresh() {
    try {
      const q = await apiJson("/quotas");
      setChildren(status);
      setChildren($("#quotas-period"), "Your team's limits and use. GPU-hours are a job's ranks times its run time, ",
        `counted over the last ${num(q.period_days, 3)} days.`);
      const custom = new Set(q.custom ?? []);
      setChildren($("#quotas-table tbody"), ROWS.map((r) => {
        const used = q.usage?.[r.usage] ?? 0;
        const limit = q.limits?.[r.limit];
        const share = limit ? Math.min(1, used / limit) : null;
        const meter = limit === null || limit === undefined ? "unlimited"
          : h("meter", { min: 0, max: 1, low: 0.7, high: 0.9, optimum: 0, value: share ?? 1,
            "aria-label": `${r.label}: ${Math.round((share ?? 1) * 100)}% used` });
        return h("tr", { "data-quota": r.limit },
          h("th", { scope: "row" }, r.label), h("td", {}, r.show(used)),
          h("td", {}, limit === null || limit === undefined ? "unlimited" : r.show(limit)),
          h("td", {}, meter, share === null ? "" : ` ${Math.round(share * 100)}%`),
          h("td", {}, custom.has(r.limit) ? "your team" : "server default"));
      }));
    } catch (err) {
      showError(status, err);
    }
  }

  $("#refresh-quotas").addEventListener("click", refresh);
  bus.addEventListener("route", (e) => { if (e.detail.view === "quotas" && getKey()) refresh(); });
  bus.addEventListener("key", () => { if (document.body.dataset.view === "quotas") refresh(); });
}
