// Datasets: upload (the server's validation errors shown by line) and the team's files (open one,
// delete one after confirming).

import { api, getKey, listAll, seg } from "./api.js";
import { $, bytes, h, setChildren, when } from "./dom.js";
import { showError, showInfo } from "./errors.js";
import { BASE_FIRST, fillModelSelect } from "./models.js";
import { confirmAction, href } from "./router.js";

const VALIDATION_KEY = "zenflow.validation.";
/** The file object's ``format``, and the method that trains on it. */
const FORMATS = {
  chat: "chat (supervised)", prompt_completion: "prompt/completion (supervised)", preference: "preference pairs (DPO)",
  reinforcement: "prompts (reinforcement)",
};

/** The upload's ``validation`` object (the check with a model), kept in this tab: the API returns it
 *  only in the upload's answer. */
export function keptValidation(fileId) {
  try {
    return JSON.parse(sessionStorage.getItem(VALIDATION_KEY + fileId) ?? "null");
  } catch {
    return null;
  }
}

/** DELETE /v1/files/{id} once the user confirms; true when deleted. */
export async function deleteFile(file, status) {
  if (!await confirmAction(`Delete the file ${file.filename} (${file.id})? Its bytes are removed from the server.`)) {
    return false;
  }
  try {
    await api(`/files/${seg(file.id)}`, { method: "DELETE" });
    sessionStorage.removeItem(VALIDATION_KEY + file.id);
    showInfo(status, `Deleted ${file.filename} (${file.id}).`);
    return true;
  } catch (err) {
    showError(status, err);
    return false;
  }
}

export function initFiles(bus) {
  const form = $("#upload-form");
  const result = $("#upload-result");
  const modelSelect = $("#upload-model");
  const tbody = $("#files-table tbody");

  async function refresh() {
    try {
      const files = await listAll("/files", { max: 500 });
      setChildren(tbody, files.map((f) => h("tr", { "data-file": f.id },
        h("td", { class: "id" }, h("a", { href: href("files", f.id) }, f.id)), h("td", {}, f.filename),
        h("td", {}, f.purpose), h("td", { class: "format" }, FORMATS[f.format] ?? f.format ?? ""),
        h("td", {}, f.num_examples ?? ""), h("td", {}, bytes(f.bytes)), h("td", {}, when(f.created_at)),
        h("td", {}, h("button", { type: "button", class: "danger", "aria-label": `Delete file ${f.id}`,
          onclick: async () => { if (await deleteFile(f, result)) await refresh(); } }, "Delete")))));
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
      if (f.validation) sessionStorage.setItem(VALIDATION_KEY + f.id, JSON.stringify(f.validation));
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
  bus.addEventListener("refresh-files", refresh);
  bus.addEventListener("route", (e) => { if (e.detail.view === "files" && getKey()) refresh(); });
  bus.addEventListener("models",
    (e) => fillModelSelect(modelSelect, e.detail, { blank: "format only", order: BASE_FIRST }));
}
