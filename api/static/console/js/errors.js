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

/** Mark the form control named by the error's ``param`` (if any) invalid; clear the others. */
export function markField(form, param) {
  for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  if (!param) return;
  const name = param.replace(/^method\.supervised\./, "");
  const field = [...form.elements].find((el) => el.name && (name === el.name || name.startsWith(`${el.name}.`)));
  if (field) {
    field.setAttribute("aria-invalid", "true");
    field.focus();
  }
}
