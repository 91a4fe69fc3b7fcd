// The job's per-step metrics (GET /v1/fine_tuning/jobs/{id}/metrics) as uPlot line charts, each with its
// latest value in text beside it; smoothing (an exponential moving average, bias-corrected as
// TensorBoard's) and a log scale for the loss; and several jobs' curves on one chart (the runs table).

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { h, num, setChildren } from "./dom.js";

const pct = (v) => (v === null || v === undefined ? null : v * 100);

/** Chart definitions: a title, a unit for the text, and series read from a metrics row. */
const CHARTS = [
  { id: "loss", title: "Loss", unit: "", logScale: true, series: [
    { label: "train loss", color: "#0969da", value: (r) => r.train_loss },
    { label: "validation loss", color: "#bc4c00", value: (r) => r.valid_loss, sparse: true },
  ] },
  { id: "stall", title: "Stall fraction", unit: "%",
    empty: "not reported: this run measured no stall (its engine mode has no offloaded optimizer step)", series: [
      { label: "stall", color: "#cf222e", value: (r) => pct(r.stall_fraction) },
    ] },
  { id: "gpu", title: "GPU utilization", unit: "%",
    empty: "not reported: this run had no GPU (a CPU run records no GPU utilization)", series: [
      { label: "GPU utilization", color: "#1a7f37", value: (r) => pct(r.gpu_utilization) },
    ] },
  { id: "tokens", title: "Tokens per second", unit: "", series: [
    { label: "tokens/s", color: "#8250df", value: (r) => r.tokens_per_second },
  ] },
  // A reinforcement job's rewards (its rows' method_metrics); shown once a row has them. Its validation
  // loss is the negative mean validation reward.
  { id: "reward", title: "Reward", unit: "", only: (r) => reward(r, "reward_mean") !== null, series: [
    { label: "mean reward", color: "#1a7f37", value: (r) => reward(r, "reward_mean") },
    { label: "min reward", color: "#9a6700", value: (r) => reward(r, "reward_min") },
    { label: "max reward", color: "#8250df", value: (r) => reward(r, "reward_max") },
    { label: "validation reward", color: "#bc4c00", value: (r) => (r.valid_loss == null ? null : -r.valid_loss),
      sparse: true },
  ] },
];

/** A figure of a reinforcement step's ``method_metrics`` (null for other methods' rows). */
function reward(row, name) {
  return row.method_metrics?.[name] ?? null;
}

/** Whole steps on the x axis. */
const STEP_INCRS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1000, 10000, 100000].map((p) => m * p)).sort((a, b) => a - b);

const PALETTE = ["#0969da", "#bc4c00", "#1a7f37", "#8250df", "#cf222e", "#9a6700", "#1b7c83", "#bf3989"];

/** ``values`` smoothed by an EMA of weight ``alpha`` (0: as is), bias-corrected; nulls stay null. */
export function ema(values, alpha) {
  if (!alpha) return values;
  let acc = 0;
  let n = 0;
  return values.map((v) => {
    if (v === null || v === undefined || !Number.isFinite(v)) return null;
    acc = alpha * acc + (1 - alpha) * v;
    n += 1;
    return acc / (1 - alpha ** n);
  });
}

function plotOptions(width, title, series, log) {
  return {
    width, height: 200,
    scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
    axes: [{ label: "step", incrs: STEP_INCRS }, { size: 60 }],
    legend: { live: false },
    series: [{ label: "step" }, ...series],
  };
}

class Chart {
  constructor(parent, def) {
    this.def = def;
    this.plotEl = h("div", { class: "plot" });
    this.latest = h("p", { class: "latest", id: `chart-${def.id}-latest` });
    this.figure = h("figure", { id: `chart-${def.id}`, "aria-describedby": `chart-${def.id}-latest` },
      h("figcaption", {}, def.title), this.plotEl, this.latest);
    parent.append(this.figure);
    this.log = false;
    this.build();
  }

  build() {
    this.plot?.destroy();
    this.plot = new uPlot(plotOptions(this.width(), this.def.title, this.def.series.map((s) => ({
      label: s.label, stroke: s.color, width: 2, spanGaps: Boolean(s.sparse),
      points: { show: Boolean(s.sparse) },
    })), this.log), [[], ...this.def.series.map(() => [])], this.plotEl);
    this.plot.root.setAttribute("role", "img");
    this.plot.root.setAttribute("aria-label", `${this.def.title} by step${this.log ? " (log scale)" : ""}`);
    this.figure.dataset.scale = this.log ? "log" : "linear";
  }

  width() {
    return Math.max(240, (this.figure.clientWidth || 400) - 20);
  }

  setLog(log) {
    if (!this.def.logScale || log === this.log) return;
    this.log = log;
    this.build();
  }

  update(rows, smoothing) {
    const steps = rows.map((r) => r.step);
    const columns = this.def.series.map((s) => rows.map((r) => s.value(r) ?? null));
    const positive = (v) => (this.log && v !== null && v <= 0 ? null : v);
    this.plot.setData([steps, ...columns.map((c, i) =>
      (this.def.series[i].sparse ? c : ema(c, smoothing)).map(positive))]);
    const parts = this.def.series.map((s, i) => {
      const last = [...columns[i]].reverse().findIndex((v) => v !== null);
      if (last < 0) return null;
      const at = rows.length - 1 - last;
      return `${s.label} ${num(columns[i][at])}${this.def.unit} at step ${steps[at]}`;
    }).filter(Boolean);
    const none = rows.length ? (this.def.empty ?? "no values yet") : "no steps yet";
    this.figure.dataset.empty = parts.length ? "false" : "true";
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
    this.smoothing = 0;
    this.container = container;
    this.charts = CHARTS.filter((def) => !def.only).map((def) => new Chart(container, def));
    this.observer = new ResizeObserver(() => this.charts.forEach((c) => c.resize()));
    this.observer.observe(container);
  }

  get lastStep() {
    return this.rows.length ? this.rows[this.rows.length - 1].step : 0;
  }

  add(rows) {
    this.rows.push(...rows.filter((r) => r.step > this.lastStep));
    this.addMethodCharts();
    this.redraw();
  }

  /** The charts of a method (``only``) once a row of it has come. */
  addMethodCharts() {
    for (const def of CHARTS.filter((d) => d.only && this.rows.some(d.only))) {
      if (!this.charts.some((c) => c.def === def)) this.charts.push(new Chart(this.container, def));
    }
  }

  redraw() {
    this.charts.forEach((c) => c.update(this.rows, this.smoothing));
  }

  setSmoothing(alpha) {
    this.smoothing = alpha;
    this.redraw();
  }

  setLog(log) {
    this.charts.forEach((c) => c.setLog(log));
    this.redraw();
  }

  destroy() {
    this.observer.disconnect();
    this.charts.forEach((c) => c.plot.destroy());
  }
}

/**
 * Several runs' ``metric`` on one chart in ``container``: ``runs`` [{label, rows}], steps joined (a run
 * without a value at a step has a gap there, spanned). Returns the uPlot (its series: step + one a run).
 */
export function compareChart(container, runs, { metric, smoothing = 0, log = false, title }) {
  setChildren(container);
  const steps = [...new Set(runs.flatMap((r) => r.rows.map((row) => row.step)))].sort((a, b) => a - b);
  const index = new Map(steps.map((s, i) => [s, i]));
  const columns = runs.map((run) => {
    const col = steps.map(() => null);
    for (const row of run.rows) {
      const v = row[metric];
      if (v !== null && v !== undefined && (!log || v > 0)) col[index.get(row.step)] = v;
    }
    return ema(col, metric === "valid_loss" ? 0 : smoothing);
  });
  const plotEl = h("div", { class: "plot" });
  const figure = h("figure", { id: "compare-figure", "data-series": String(runs.length), "data-metric": metric,
    "data-scale": log ? "log" : "linear", "data-smoothing": String(smoothing) },
    h("figcaption", {}, title), plotEl);
  container.append(figure);
  const width = Math.max(320, (container.clientWidth || 800) - 20);
  const plot = new uPlot(plotOptions(width, title, runs.map((run, i) => ({
    label: run.label, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true,
    points: { show: metric === "valid_loss" },
  })), log), [steps, ...columns], plotEl);
  plot.root.setAttribute("role", "img");
  plot.root.setAttribute("aria-label", `${title}: ${runs.map((r) => r.label).join(", ")}`);
  return plot;
}
