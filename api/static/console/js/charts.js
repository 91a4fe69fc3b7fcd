// The job's per-step metrics (GET /v1/fine_tuning/jobs/{id}/metrics) as uPlot line charts, each with its
// latest value in text beside it; smoothing (an exponential moving average, bias-corrected as
// TensorBoard's) and a log scale for the loss; and several jobs' curves on one chart (the runs table).

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { h, num, setChildren } from "./dom.js";

const pct = (v) => (v === null || v === undefined ? null : v * 100);

/**
 * Chart definitions: a title (by method where it differs), a unit for the text, and series read from a
 * metrics row. ``methods``: the job methods it is drawn for (all when absent), in this order, the
 * method's own charts first.
 */
const CHARTS = [
  // A DPO job's rewards (its rows' method_metrics): beta x (policy - reference) log-probabilities.
  { id: "margin", title: "DPO reward margin", unit: "", methods: ["dpo"], series: [
    { label: "reward margin", color: "#1a7f37", value: (r) => figure(r, "reward_margin") },
    { label: "chosen reward", color: "#0969da", value: (r) => figure(r, "chosen_reward") },
    { label: "rejected reward", color: "#cf222e", value: (r) => figure(r, "rejected_reward") },
  ] },
  { id: "accuracy", title: "DPO preference accuracy", unit: "%", methods: ["dpo"], series: [
    { label: "accuracy", color: "#8250df", value: (r) => pct(figure(r, "accuracy")) },
  ] },
  // A reinforcement job's rewards; its validation loss is the negative mean validation reward.
  { id: "reward", title: "Reward", unit: "", methods: ["reinforcement"], series: [
    { label: "mean reward", color: "#1a7f37", value: (r) => figure(r, "reward_mean") },
    { label: "min reward", color: "#9a6700", value: (r) => figure(r, "reward_min") },
    { label: "max reward", color: "#8250df", value: (r) => figure(r, "reward_max") },
    { label: "validation reward", color: "#bc4c00", value: (r) => (r.valid_loss == null ? null : -r.valid_loss),
      sparse: true },
  ] },
  { id: "loss", title: { supervised: "Loss", dpo: "DPO loss", reinforcement: "Policy loss" }, unit: "",
    logScale: true, series: [
      { label: "train loss", color: "#0969da", value: (r) => r.train_loss },
      // A reinforcement job's valid_loss is its negative validation reward: drawn on the reward chart.
      { label: "validation loss", color: "#bc4c00", value: (r) => r.valid_loss, sparse: true,
        methods: ["supervised", "dpo"] },
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
];

/** A figure of a DPO or reinforcement step's ``method_metrics`` (null for a supervised row). */
function figure(row, name) {
  return row.method_metrics?.[name] ?? null;
}

/** A metrics row's ``metric``: one of its own fields, else a figure of its method's. */
export function metricValue(row, metric) {
  return row[metric] ?? figure(row, metric);
}

const drawnFor = (def, method) => !def.methods || def.methods.includes(method);

/** The chart definitions of ``method``, each with its title and series for it. */
function chartsFor(method) {
  return CHARTS.filter((def) => drawnFor(def, method)).map((def) => ({
    ...def,
    title: typeof def.title === "string" ? def.title : def.title[method],
    series: def.series.filter((s) => drawnFor(s, method)),
  }));
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

/** The charts of one job in ``container``: add metrics rows as they come; ``setMethod`` once the job's
 *  method is known (supervised's charts until then). */
export class MetricCharts {
  constructor(container) {
    this.rows = [];
    this.smoothing = 0;
    this.log = false;
    this.container = container;
    this.charts = [];
    this.setMethod("supervised");
    this.observer = new ResizeObserver(() => this.charts.forEach((c) => c.resize()));
    this.observer.observe(container);
  }

  /** Draw ``method``'s charts (its own first: DPO's reward margin and accuracy, reinforcement's reward). */
  setMethod(method) {
    if (method === this.method) return;
    this.method = method;
    this.charts.forEach((c) => c.plot.destroy());
    setChildren(this.container);
    this.container.dataset.method = method;
    this.charts = chartsFor(method).map((def) => new Chart(this.container, def));
    if (this.log) this.charts.forEach((c) => c.setLog(true));
    this.redraw();
  }

  get lastStep() {
    return this.rows.length ? this.rows[this.rows.length - 1].step : 0;
  }

  add(rows) {
    this.rows.push(...rows.filter((r) => r.step > this.lastStep));
    this.redraw();
  }

  redraw() {
    this.charts.forEach((c) => c.update(this.rows, this.smoothing));
  }

  setSmoothing(alpha) {
    this.smoothing = alpha;
    this.redraw();
  }

  setLog(log) {
    this.log = log;
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
      const v = metricValue(row, metric);
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
