// How a refused request is shown: the server's message, its code and field, and for a dataset the
// errors by line (the upload's ``errors: [{line, field, message, detail}]``).

import { h, setChildren } from "./dom.js";

/** Show ``err`` (an ApiError or any Error) in ``container`` as an alert. */
export function showError(container, err) {
  container.setAttribute("role", "alert");
  container.className = "error";
  const facts = [];
  if (err.status) facts.push(`HTTP ${err.status}`);
  if (err.code) facts.push(`code ${err.code}`);
  if (err.param) facts.push(`field ${err.param}`);
  if (err.retryAfter) facts.push(`retry after ${err.retryAfter} s`);
  const parts = [h("p", {}, h("strong", {}, err.message), facts.length ? ` (${facts.join(", ")})` : "")];
  if (err.errors?.length) {
    parts.push(h("table", { class: "line-errors" },
      h("caption", {}, `${err.errors.length} problem${err.errors.length === 1 ? "" : "s"} by line`),
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Line"), h("th", { scope: "col" }, "Field"),
        h("th", { scope: "col" }, "Problem"))),
      h("tbody", {}, err.errors.map((e) => h("tr", {},
        h("td", {}, e.line ?? ""), h("td", { class: "mono" }, e.field ?? ""),
        h("td", {}, e.message ?? "", e.detail ? ` (${e.detail})` : "")))),
    ));
  }
  setChildren(container, parts);
}

/** Show a success or progress message in ``container``. */
export function showInfo(container, ...content) {
  container.setAttribute("role", "status");
  container.className = "ok";
  setChildren(container, h("p", {}, ...content));
}

/** The form control an error's ``param`` names: ``method.<type>.`` (a DPO or reinforcement job's
 *  settings) and ``method.reinforcement.grader`` map to the form's own fields; the longest name that
 *  ``param`` starts with wins (``hyperparameters.lora.alpha`` before ``hyperparameters.lora``). */
function fieldOf(form, param) {
  const name = param.replace(/^method\.(supervised|dpo|reinforcement)\./, "")
    .replace(/^(supervised|dpo|reinforcement)\./, "");
  const named = [...form.elements].filter((el) => el.name && !el.hidden
    && (name === el.name || name.startsWith(`${el.name}.`) || name.startsWith(`${el.name}[`)));
  return named.sort((a, b) => b.name.length - a.name.length)[0] ?? null;
}

/**
 * Mark the form control named by the error's ``param`` (if any) invalid and show ``message`` beside it
 * (its ``aria-describedby``); clear the marks and messages of the others.
 */
export function markField(form, param, message) {
  for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  for (const el of form.querySelectorAll(".field-error")) {
    const owner = form.querySelector(`[aria-describedby~="${el.id}"]`);
    if (owner) {
      const rest = owner.getAttribute("aria-describedby").split(" ").filter((id) => id !== el.id);
      if (rest.length) owner.setAttribute("aria-describedby", rest.join(" "));
      else owner.removeAttribute("aria-describedby");
    }
    el.remove();
  }
  if (!param) return;
  const field = fieldOf(form, param);
  if (!field) return;
  field.setAttribute("aria-invalid", "true");
  if (message) {
    const id = `${field.id}-error`;
    const note = h("p", { id, class: "field-error error", role: "alert", "data-param": param }, message);
    field.after(note);
    field.setAttribute("aria-describedby", [field.getAttribute("aria-describedby"), id].filter(Boolean).join(" "));
  }
  field.focus();
}
