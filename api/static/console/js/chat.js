// Chat with a model (POST /v1/chat/completions, stream: true): the reply appears as its chunks arrive;
// Stop closes the request, which frees the server's generation slot.

import { api, apiJson, serverEvents } from "./api.js";
import { $, h, setChildren } from "./dom.js";
import { showError, showInfo } from "./errors.js";
import { fillModelSelect } from "./models.js";
import { go } from "./router.js";

/** Make ``id`` the choice of ``select`` (added as an option when the list does not have it yet). */
function choose(select, id) {
  if (!id) return;
  if (![...select.options].some((o) => o.value === id)) select.append(h("option", { value: id }, id));
  select.value = id;
}

/**
 * Side by side: the same prompt to two models (POST /v1/chat/completions each, not streamed, one after
 * the other so neither waits on the other's generation slot), answers in two columns.
 */
function initSideBySide(bus) {
  const form = $("#side-form");
  const status = $("#side-status");
  const left = $("#side-left");
  const right = $("#side-right");
  const panes = [$("#side-left-answer"), $("#side-right-answer")];

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const prompt = $("#side-input").value.trim();
    if (!prompt) return;
    const send = $("#side-send");
    send.disabled = true;
    const models = [left.value, right.value];
    panes.forEach((pane, i) => {
      setChildren(pane.querySelector("figcaption"), models[i]);
      setChildren(pane.querySelector(".text"), "...");
      pane.dataset.state = "waiting";
    });
    showInfo(status, "Asking both models...");
    const usage = [];
    for (const [i, model] of models.entries()) {
      try {
        const answer = await apiJson("/chat/completions", { method: "POST", json: {
          model, messages: [{ role: "user", content: prompt }], temperature: 0,
          max_tokens: Number.parseInt($("#side-max-tokens").value || "64", 10),
        } });
        setChildren(panes[i].querySelector(".text"), answer.choices?.[0]?.message?.content ?? "");
        panes[i].dataset.state = "done";
        usage.push(`${model}: ${answer.usage?.completion_tokens ?? "?"} tokens`);
      } catch (err) {
        panes[i].dataset.state = "error";
        showError(panes[i].querySelector(".text"), err);
      }
    }
    showInfo(status, `Answered (temperature 0): ${usage.join("; ")}.`);
    send.disabled = false;
  });
  bus.addEventListener("models", (e) => {
    fillModelSelect(left, e.detail);
    fillModelSelect(right, e.detail);
  });
  bus.addEventListener("side-by-side", (e) => {
    go("chat");
    choose(left, e.detail.left);
    choose(right, e.detail.right);
    $("#side-section").scrollIntoView({ block: "start" });
    $("#side-input").focus();
  });
}

export function initChat(bus) {
  const form = $("#chat-form");
  const log = $("#chat-log");
  const status = $("#chat-status");
  const send = $("#chat-send");
  const stopButton = $("#chat-stop");
  const modelSelect = $("#chat-model");
  let history = [];
  let ctl = null;

  function message(role, text) {
    const body = h("span", { class: "text" }, text);
    const li = h("li", { class: role }, h("span", { class: "who" }, role === "user" ? "You" : "Model"), body);
    log.append(li);
    return { li, body };
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const input = $("#chat-input");
    const content = input.value.trim();
    if (!content || ctl) return;
    input.value = "";
    message("user", content);
    history.push({ role: "user", content });
    const reply = message("assistant", "");
    reply.li.dataset.state = "streaming";
    const system = $("#chat-system").value.trim();
    const body = {
      model: modelSelect.value,
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      temperature: Number($("#chat-temperature").value || 0),
      max_tokens: Number.parseInt($("#chat-max-tokens").value || "64", 10),
      stream: true,
      stream_options: { include_usage: true },
    };
    ctl = new AbortController();
    send.disabled = true;
    stopButton.disabled = false;
    showInfo(status, "Generating...");
    let text = "";
    let finish = null;
    try {
      const response = await api("/chat/completions", { method: "POST", json: body, signal: ctl.signal,
        headers: { Accept: "text/event-stream" } });
      for await (const ev of serverEvents(response)) {
        if (ev.data === "[DONE]") break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) throw Object.assign(new Error(chunk.error.message), { code: chunk.error.code });
        for (const choice of chunk.choices ?? []) {
          if (choice.delta?.content) {
            text += choice.delta.content;
            setChildren(reply.body, text);
          }
          finish = choice.finish_reason ?? finish;
        }
        if (chunk.usage) {
          reply.li.dataset.completionTokens = String(chunk.usage.completion_tokens);
          const { prompt_tokens: prompt, completion_tokens: completion } = chunk.usage;
          showInfo(status, `${prompt} prompt tokens, ${completion} completion tokens`,
            finish ? ` (finish: ${finish}).` : ".");
        }
      }
      history.push({ role: "assistant", content: text });
      reply.li.dataset.state = "done";
      if (finish) reply.li.dataset.finishReason = finish;
    } catch (err) {
      reply.li.dataset.state = "error";
      history.pop();  // the question went unanswered: leave it out of the next request
      if (err.name === "AbortError") showInfo(status, "Stopped.");
      else showError(status, err);
    } finally {
      ctl = null;
      send.disabled = false;
      stopButton.disabled = true;
    }
  });
  stopButton.addEventListener("click", () => ctl?.abort());
  $("#chat-clear").addEventListener("click", () => {
    ctl?.abort();
    history = [];
    setChildren(log);
    setChildren(status);
  });
  bus.addEventListener("models", (e) => fillModelSelect(modelSelect, e.detail));
  bus.addEventListener("chat-model", (e) => {
    go("chat");
    choose(modelSelect, e.detail);
    $("#chat-section").scrollIntoView({ block: "start" });
    $("#chat-input").focus();
  });
  initSideBySide(bus);
}
