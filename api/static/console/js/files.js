// Datasets: upload (the server's validation errors shown by line) and the team's files.

import { api, listAll } from "./api.js";
import { $, bytes, h, setChildren, when } from "./dom.js";
import { showError, showInfo } from "./errors.js";
import { BASE_FIRST, fillModelSelect } from "./models.js";

export function initFiles(bus) {
  const form = $("#upload-form");
  const result = $("#upload-result");
  const modelSelect = $("#upload-model");
  const tbody = $("#files-table tbody");

  async function refresh() {
    try {
      const files = await listAll("/files", { max: 500 });
      setChildren(tbody, files.map((f) => h("tr", {},
        h("td", { class: "id" }, f.id), h("td", {}, f.filename), h("td", {}, f.purpose),
        h("td", {}, f.num_examples ?? ""), h("td", {}, bytes(f.bytes)), h("td", {}, when(f.created_at)))));
      bus.dispatchEvent(new CustomEvent("files", { detail: files }));
    } catch (err) {
      showError(result, err);
    }
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const file = $("#upload-file").files[0];
    if (!file) return;
    const body = new FormData();
    body.append("purpose", "fine-tune");
    if (modelSelect.value) body.append("model", modelSelect.value);
    body.append("file", file, file.name);
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    showInfo(result, `Uploading ${file.name} (${bytes(file.size)})...`);
    try {
      const f = await (await api("/files", { method: "POST", form: body })).json();
      const summary = f.validation?.summary ? ` ${f.validation.summary}` : "";
      showInfo(result, "Uploaded ", h("span", { class: "mono" }, f.id), `: ${f.num_examples} examples.${summary}`);
      form.reset();
      await refresh();
    } catch (err) {
      showError(result, err);
    } finally {
      button.disabled = false;
    }
  });
  $("#refresh-files").addEventListener("click", refresh);
  bus.addEventListener("key", refresh);
  bus.addEventListener("models",
    (e) => fillModelSelect(modelSelect, e.detail, { blank: "format only", order: BASE_FIRST }));
}
