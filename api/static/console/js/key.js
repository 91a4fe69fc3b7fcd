// The API key section: keep the pasted key (this tab, or this device), check it against the server.
// Once a key is accepted the section folds to one line (the views start at the top of the page).

import { forgetKey, getKey, keyRemembered, setKey } from "./api.js";
import { $ } from "./dom.js";
import { showError, showInfo } from "./errors.js";
import { loadModels } from "./models.js";

export function initKey(bus) {
  const form = $("#key-form");
  const input = $("#api-key");
  const remember = $("#remember-key");
  const status = $("#key-status");
  const section = $("#key-section");

  /** The form (no key yet, or changing it), or the one line of a key in use. */
  function folded(fold) {
    form.hidden = fold;
    $("#key-heading").hidden = fold;
    $("#key-set").hidden = !fold;
    section.classList.toggle("folded", fold);
  }

  async function check() {
    try {
      const models = await loadModels();
      showInfo(status, `Key accepted: ${models.length} models available.`);
      folded(true);
      bus.dispatchEvent(new CustomEvent("models", { detail: models }));
      bus.dispatchEvent(new CustomEvent("key"));
    } catch (err) {
      showError(status, err);
      folded(false);
    }
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    setKey(input.value.trim(), remember.checked);
    input.value = "";
    check();
  });
  $("#forget-key").addEventListener("click", () => {
    forgetKey();
    showInfo(status, "Key forgotten.");
  });
  $("#change-key").addEventListener("click", () => {
    folded(false);
    input.focus();
  });

  remember.checked = keyRemembered();
  if (getKey()) check();
  else showInfo(status, "Paste your team's API key (zenflow keys create --team NAME).");
}
