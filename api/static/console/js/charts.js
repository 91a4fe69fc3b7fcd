// The job's per-step metrics (GET /v1/fine_tuning/jobs/{id}/metrics) as uPlot line charts, each with its
// latest value in text beside it.

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { h, num, setChildren } from "./dom.js";

const pct = (v) => (v === null || v === undefined ? null : v * 100);

/** Chart definitions: a title, a unit for the text, and series read from a metrics row. */
const CHARTS = [
  { id: "loss", title: "Loss", unit: "", series: [
    { label: "train loss", color: "#0969da", value: (r) => r.train_loss },
    { label: "validation loss", color: "#bc4c00", value: (r) => r.valid_loss, sparse: true },
  ] },
  { id: "stall", title: "Stall fraction", unit: "%", series: [
    { label: "stall", color: "#cf222e", value: (r) => pct(r.stall_fraction) },
  ] },
  { id: "gpu", title: "GPU utilization", unit: "%", empty: "not reported (no GPU in this run)", series: [
    { label: "GPU utilization", color: "#1a7f37", value: (r) => pct(r.gpu_utilization) },
  ] },
  { id: "tokens", title: "Tokens per second", unit: "", series: [
    { label: "tokens/s", color: "#8250df", value: (r) => r.tokens_per_second },
  ] },
];

class Chart {
  constructor(parent, def) {
    this.def = def;
    this.plotEl = h("div", { class: "plot" });
    this.latest = h("p", { class: "latest", id: `chart-${def.id}-latest` });
    this.figure = h("figure", { id: `chart-${def.id}`, "aria-describedby": `chart-${def.id}-latest` },
      h("figcaption", {}, def.title), this.plotEl, this.latest);
    parent.append(this.figure);
    this.plot = new uPlot({
      width: this.width(), height: 200,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { size: 60 }],
      legend: { live: false },
      series: [{ label: "step" }, ...def.series.map((s) => ({
        label: s.label, stroke: s.color, width: 2, spanGaps: Boolean(s.sparse),
        points: { show: Boolean(s.sparse) },
      }))],
    }, [[], ...def.series.map(() => [])], this.plotEl);
    this.plot.root.setAttribute("role", "img");
    this.plot.root.setAttribute("aria-label", `${def.title} by step`);
  }

  width() {
    return Math.max(240, (this.figure.clientWidth || 400) - 20);
  }

  update(rows) {
    const steps = rows.map((r) => r.step);
    const columns = this.def.series.map((s) => rows.map((r) => s.value(r) ?? null));
    this.plot.setData([steps, ...columns]);
    const parts = this.def.series.map((s, i) => {
      const last = [...columns[i]].reverse().findIndex((v) => v !== null);
      if (last < 0) return null;
      const at = rows.length - 1 - last;
      return `${s.label} ${num(columns[i][at])}${this.def.unit} at step ${steps[at]}`;
    }).filter(Boolean);
    const none = rows.length ? (this.def.empty ?? "no values yet") : "no steps yet";
    setChildren(this.latest, parts.length ? parts.join("; ") : none);
  }

  resize() {
    this.plot.setSize({ width: this.width(), height: 200 });
  }
}

/** The charts of one job in ``container``: add metrics rows as they come. */
export class MetricCharts {
  constructor(container) {
    setChildren(container);
    this.rows = [];
    this.charts = CHARTS.map((def) => new Chart(container, def));
    this.observer = new ResizeObserver(() => this.charts.forEach((c) => c.resize()));
    this.observer.observe(container);
  }

  get lastStep() {
    return this.rows.length ? this.rows[this.rows.length - 1].step : 0;
  }

  add(rows) {
    this.rows.push(...rows.filter((r) => r.step > this.lastStep));
    this.charts.forEach((c) => c.update(this.rows));
  }

  destroy() {
    this.observer.disconnect();
    this.charts.forEach((c) => c.plot.destroy());
  }
}
