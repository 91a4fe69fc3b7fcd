// A job's plan (its event's ``data.plan``: trainer.plan.records.Plan) as a table a person reads: bytes in
// KiB/MiB/GiB with the share of what the machine has, seconds in s, counts grouped, shares in %.

import { bytes, h, num } from "./dom.js";

const count = (n) => Number(n).toLocaleString("en-US");
const pctOf = (part, whole) => (whole ? ` (${num((100 * part) / whole, 3)}%)` : "");
/** "1.2 GiB of 21.5 GiB (5.6%)", or undefined when the plan has no such figure. */
const used = (part, whole) => (part === undefined ? undefined : `${bytes(part)} of ${bytes(whole)}${pctOf(part, whole)}`);
const seconds = (s) => `${num(s, 3)} s`;
const yesNo = (v) => (v ? "yes" : "no");

/** The plan's rows: [label, text], in reading order; the fields a plan leaves out are skipped. */
export function planRows(plan) {
  const s = plan.settings ?? {};
  const m = plan.machine ?? {};
  const rows = [
    ["fits", yesNo(plan.fits)],
    ["machine", m.gpu_name ? `${m.gpu_name}${m.device_type === "cpu" ? " (CPU)" : ""}` : undefined],
    ["engine mode", s.mode],
    ["micro-batch", s.micro_batch_size],
    ["gradient checkpointing", s.gradient_checkpointing === undefined ? undefined : yesNo(s.gradient_checkpointing)],
    ["weights", s.shard_params === undefined ? undefined
      : `${s.shard_params ? "sharded" : "replicated"} over ${plan.ranks ?? 1} rank(s)`],
    ["parameters", plan.params === undefined ? undefined : count(plan.params)],
    ["trainable parameters", plan.trainable_params === undefined ? undefined
      : `${count(plan.trainable_params)}${pctOf(plan.trainable_params, plan.params)}`],
    ["dtype", plan.dtype],
    ["batch size", plan.batch_size],
    ["max sequence length", plan.max_seq_length === undefined ? undefined : `${count(plan.max_seq_length)} tokens`],
    ["tokens per step", plan.tokens_per_step === undefined ? undefined : count(plan.tokens_per_step)],
    ["device memory (a rank)", used(plan.device_bytes, plan.device_capacity_bytes)],
    ["host memory (a rank)", used(plan.host_bytes, plan.host_capacity_bytes)],
    ["host memory (all ranks)", (plan.ranks ?? 1) > 1 ? bytes(plan.host_bytes_all_ranks) : undefined],
    ["step time (predicted)", plan.step_seconds === undefined ? undefined : seconds(plan.step_seconds)],
    ["of it sampling", plan.generation_seconds ? seconds(plan.generation_seconds) : undefined],
    ["rollout KV cache", plan.rollout_cache_bytes ? bytes(plan.rollout_cache_bytes) : undefined],
    ["tokens per second (predicted)",
      plan.tokens_per_second === undefined ? undefined : count(Math.round(plan.tokens_per_second))],
  ];
  return rows.filter(([, v]) => v !== undefined && v !== null);
}

/** The plan's memory by component (device, host), largest first, as "name: 1.2 GiB" items. */
function components(title, parts) {
  const items = Object.entries(parts ?? {}).filter(([, v]) => v > 0).sort((a, b) => b[1] - a[1]);
  if (!items.length) return null;
  return h("details", {}, h("summary", {}, title),
    h("ul", { class: "components" }, items.map(([k, v]) => h("li", {}, `${k.replaceAll("_", " ")}: ${bytes(v)}`))));
}

/** The plan as nodes: its summary line, the table, its reasons and problems, the memory by component. */
export function planView(message, plan) {
  const problems = plan.problems ?? [];
  return [
    h("p", {}, message),
    h("table", { class: "kv", id: "job-plan-table" }, h("caption", { class: "sr-only" }, "The job's plan"),
      h("tbody", {}, planRows(plan).map(([k, v]) => h("tr", {}, h("th", { scope: "row" }, k), h("td", {}, String(v)))))),
    problems.length ? h("ul", { class: "error" }, problems.map((p) => h("li", {},
      p.loc?.length ? h("code", {}, p.loc.join(".")) : "", p.loc?.length ? ": " : "", p.message))) : null,
    plan.reasons?.length ? h("details", {}, h("summary", {}, "Why these settings"),
      h("ul", {}, plan.reasons.map((r) => h("li", {}, r)))) : null,
    components("Device memory by component", plan.device),
    components("Host memory by component", plan.host),
  ];
}
