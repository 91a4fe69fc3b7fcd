// One dataset's view (#/files/<id>): the file object, the check with a model kept from its upload
// (GET /v1/files does not return it), problems by line and a length histogram from the file's first
// lines (GET /v1/files/{id}/content, read up to PREVIEW_BYTES), and, with the model chosen in the view
// (GET /v1/files/{id}/preview), its first examples rendered as that model will see them with the learned
// text marked and a histogram of tokens per example. When the preview fails the view says why and shows
// the examples as chat turns and a histogram of characters instead.

import { api, apiJson, getKey, seg } from "./api.js";
import { $, bytes, h, num, setChildren, when } from "./dom.js";
import { showError } from "./errors.js";
import { deleteFile, keptValidation } from "./files.js";
import { BASE_FIRST, fillModelSelect, loadModels } from "./models.js";
import { go } from "./router.js";

const PREVIEW_BYTES = 2 * 1024 * 1024;
const SHOWN_EXAMPLES = 5;
const BINS = 10;
const ROLES = new Set(["system", "developer", "user", "assistant", "tool"]);

/** The first ``limit`` bytes of the file's content as text (whole lines only unless it all came). */
async function head(fileId, limit) {
  const response = await api(`/files/${seg(fileId)}/content`);
  const reader = response.body.getReader();
  const chunks = [];
  let received = 0;
  let complete = false;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) { complete = true; break; }
    chunks.push(value);
    received += value.length;
    if (received >= limit) { reader.cancel().catch(() => {}); break; }
  }
  let text = new TextDecoder().decode(await new Blob(chunks).arrayBuffer());
  if (!complete) text = text.slice(0, text.lastIndexOf("\n") + 1);
  return { text: text.replace(/^\uFEFF/, ""), complete };
}

/** A message's content as text (a string, or a list of text parts). */
function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (p && typeof p.text === "string" ? p.text : "")).join("");
  return "";
}

/** One line: {line, turns: [{role, text, learned}], chars, problems: [text]}. */
export function parseLine(raw, line) {
  const out = { line, turns: [], chars: 0, problems: [] };
  let obj;
  try {
    obj = JSON.parse(raw);
  } catch (err) {
    out.problems.push(`not JSON (${err.message})`);
    return out;
  }
  if (!obj || typeof obj !== "object" || Array.isArray(obj)) {
    out.problems.push("not a JSON object");
    return out;
  }
  if (Array.isArray(obj.messages)) {
    obj.messages.forEach((m, i) => {
      if (!m || typeof m !== "object" || !ROLES.has(m.role)) {
        out.problems.push(`messages[${i}].role: not one of ${[...ROLES].join(", ")}`);
        return;
      }
      let text = contentText(m.content);
      if (m.tool_calls) text += (text ? "\n" : "") + `tool calls: ${JSON.stringify(m.tool_calls)}`;
      out.turns.push({ role: m.role, text, learned: m.role === "assistant" && m.weight !== 0 });
    });
    if (!out.turns.some((t) => t.role === "assistant")) out.problems.push("messages: no assistant turn to learn from");
    else if (!out.turns.some((t) => t.learned)) out.problems.push("messages: every assistant turn has weight 0");
  } else if (typeof obj.prompt === "string" && typeof obj.completion === "string") {
    out.turns.push({ role: "prompt", text: obj.prompt, learned: false },
      { role: "completion", text: obj.completion, learned: true });
  } else {
    out.problems.push("neither messages nor prompt and completion");
  }
  out.chars = out.turns.reduce((n, t) => n + t.text.length, 0);
  return out;
}

function histogram(container, values, unit) {
  if (!values.length) {
    setChildren(container, h("p", { class: "hint" }, "No examples to count."));
    return;
  }
  const lo = Math.min(...values);
  const hi = Math.max(...values);
  const width = Math.max(1, Math.ceil((hi - lo + 1) / BINS));
  const counts = Array.from({ length: BINS }, () => 0);
  for (const v of values) counts[Math.min(BINS - 1, Math.floor((v - lo) / width))] += 1;
  const top = Math.max(...counts);
  const bars = counts.map((c, i) => {
    const bar = h("span", { class: "bar" });
    bar.style.width = `${top ? (100 * c) / top : 0}%`;  // CSSOM, allowed by the page's CSP
    return h("tr", {}, h("th", { scope: "row" }, `${lo + i * width}-${lo + (i + 1) * width - 1}`),
      h("td", { class: "bar-cell" }, bar), h("td", {}, c));
  });
  const sorted = [...values].sort((a, b) => a - b);
  setChildren(container,
    h("p", {}, `${values.length} examples: ${unit} per example min ${lo}, median ${sorted[Math.floor(sorted.length / 2)]}, max ${hi}.`),
    h("table", { class: "hist", id: "file-histogram-table" },
      h("caption", {}, `Examples by ${unit} (bins of ${width})`),
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, unit), h("th", { scope: "col" }, "share"),
        h("th", { scope: "col" }, "examples"))),
      h("tbody", {}, bars)));
}

/** One example of GET /v1/files/{id}/preview: the rendered text, learned pieces marked. */
function rendered(ex) {
  return h("li", { class: "example", "data-line": ex.line },
    h("p", { class: "hint" }, `line ${ex.line}: ${ex.tokens} tokens, ${ex.learned_tokens} learned`),
    h("pre", { class: "rendered" }, ex.pieces.map((p) => h("span",
      { class: p.learned ? "piece learned-piece" : "piece" }, p.text))));
}

function example(ex) {
  return h("li", { class: "example", "data-line": ex.line },
    h("p", { class: "hint" }, `line ${ex.line}`),
    h("ol", { class: "turns" }, ex.turns.map((t) => h("li", { class: `turn role-${t.role}${t.learned ? " learned" : ""}` },
      h("span", { class: "who" }, t.role, t.learned ? h("span", { class: "badge" }, "learned") : ""),
      h("span", { class: "text" }, t.text)))));
}

export function initDataset(bus) {
  const status = $("#file-status");
  const modelSelect = $("#file-model");
  let file = null;
  let token = 0;
  let parsed = [];  // the lines read from the file's head (the character view's)
  let modelsLoaded = false;

  async function ensureModels() {
    if (modelsLoaded) return;
    fillModelSelect(modelSelect, await loadModels(), { order: BASE_FIRST });
    modelsLoaded = true;
  }

  /** The histogram and examples: with the chosen model's rendering, else the character view (saying why). */
  async function showExamples(id, mine) {
    const note = $("#file-preview-note");
    setChildren(note);
    try {
      await ensureModels();
      if (!modelSelect.value) throw new Error("no usable model to render it with");
      const model = modelSelect.value;
      const p = await apiJson(`/files/${seg(id)}/preview`, { query: { model, limit: SHOWN_EXAMPLES } });
      if (mine !== token) return;
      setChildren($("#file-lengths-heading"), "Example lengths (tokens)");
      histogram($("#file-histogram"), p.token_counts, "tokens");
      if (p.truncated_at) {
        setChildren(note, `Some examples are longer than ${p.truncated_at} tokens, the max_seq_length a job `
          + "with this model cuts them at by default.");
      }
      setChildren($("#file-examples"), p.examples.map(rendered));
    } catch (err) {
      if (mine !== token) return;
      setChildren(note, `Not rendered with the model (${err.message || err}): showing the messages and `
        + "character counts instead.");
      setChildren($("#file-lengths-heading"), "Example lengths (characters)");
      histogram($("#file-histogram"), parsed.filter((e) => !e.problems.length).map((e) => e.chars), "characters");
      setChildren($("#file-examples"), parsed.filter((e) => e.turns.length).slice(0, SHOWN_EXAMPLES).map(example));
    }
  }

  async function open(id) {
    const mine = ++token;
    file = null;
    parsed = [];
    setChildren($("#file-id"), id);
    for (const sel of ["#file-facts", "#file-validation", "#file-problems", "#file-histogram", "#file-examples"]) {
      setChildren($(sel));
    }
    setChildren(status);
    try {
      const f = await apiJson(`/files/${seg(id)}`);
      if (mine !== token) return;
      file = f;
      setChildren($("#file-facts"), [["Name", f.filename], ["Purpose", f.purpose], ["Examples", f.num_examples],
        ["Size", bytes(f.bytes)], ["Uploaded", when(f.created_at)], ["SHA-256", f.sha256]]
        .filter(([, v]) => v !== undefined && v !== null)
        .flatMap(([k, v]) => [h("dt", {}, k), h("dd", { class: k === "SHA-256" ? "mono" : null }, v)]));
      const v = keptValidation(f.id);
      setChildren($("#file-validation"), v
        ? h("table", { class: "kv", id: "file-validation-table" },
          h("caption", { class: "sr-only" }, "The check with a model at upload"),
          h("tbody", {}, [["summary", v.summary], ["model", v.model], ["max_seq_length", v.max_seq_length],
            ["truncation", v.truncation], ["examples kept", v.num_examples], ["tokens", v.num_tokens],
            ["tokens per example (mean)", v.num_tokens && v.num_examples ? num(v.num_tokens / v.num_examples) : null],
            ["truncated", v.num_truncated], ["truncated lines", v.truncated_lines?.join(", ")],
            ["dropped", v.num_dropped], ["dropped lines", v.dropped_lines?.join(", ")]]
            .filter(([, x]) => x !== undefined && x !== null && x !== "")
            .map(([k, x]) => h("tr", {}, h("th", { scope: "row" }, k), h("td", {}, x)))))
        : h("p", { class: "hint" }, "Not checked with a model in this browser tab: upload it with \"Check with model\" "
          + "to see its token counts here (the API returns them only in the upload's answer)."));
      if (f.purpose !== "fine-tune") {
        setChildren($("#file-examples"), h("li", { class: "hint" }, `A ${f.purpose} file: no examples to show.`));
        return;
      }
      const { text, complete } = await head(f.id, PREVIEW_BYTES);
      if (mine !== token) return;
      const lines = text.split(/\r?\n/);
      const examples = [];
      lines.forEach((raw, i) => { if (raw.trim()) examples.push(parseLine(raw, i + 1)); });
      const problems = examples.filter((e) => e.problems.length);
      const scope = complete ? "the whole file" : `its first ${bytes(PREVIEW_BYTES)}`;
      setChildren($("#file-problems"), problems.length
        ? h("table", { class: "line-errors", id: "file-problems-table" },
          h("caption", {}, `${problems.length} line${problems.length === 1 ? "" : "s"} with problems in ${scope}`),
          h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Line"), h("th", { scope: "col" }, "Problem"))),
          h("tbody", {}, problems.flatMap((e) => e.problems.map((p) => h("tr", {}, h("td", {}, e.line), h("td", {}, p))))))
        : h("p", { class: "ok" }, `No problems found in ${scope} (${examples.length} examples read).`));
      parsed = examples;
      await showExamples(f.id, mine);
    } catch (err) {
      if (mine === token) showError(status, err);
    }
  }

  modelSelect.addEventListener("change", () => { if (file) showExamples(file.id, ++token); });
  bus.addEventListener("models", (e) => {
    fillModelSelect(modelSelect, e.detail, { order: BASE_FIRST });
    modelsLoaded = true;
  });
  $("#delete-file").addEventListener("click", async () => {
    if (!file) return;
    if (await deleteFile(file, status)) {
      bus.dispatchEvent(new CustomEvent("refresh-files"));
      go("files");
    }
  });
  let route = null;
  bus.addEventListener("route", (e) => {
    route = e.detail;
    if (route.view === "file" && getKey()) open(route.id);
  });
  bus.addEventListener("key", () => { if (route?.view === "file") open(route.id); });
}
