// The console's entry point: one event bus between the sections.
//   key        the key was set (every section reloads)       models  GET /v1/models answered
//   files      GET /v1/files answered                         follow  follow this job id
//   job-finished  a followed job ended (models reload)        chat-model  chat with this model id

import { initChat } from "./chat.js";
import { initFiles } from "./files.js";
import { initFollow } from "./follow.js";
import { initJobs } from "./jobs.js";
import { initKey } from "./key.js";
import { loadModels } from "./models.js";

const bus = new EventTarget();
initFiles(bus);
initJobs(bus);
initFollow(bus);
initChat(bus);
bus.addEventListener("job-finished", async () => {
  try {
    bus.dispatchEvent(new CustomEvent("models", { detail: await loadModels() }));
  } catch { /* the key section shows key problems */ }
});
initKey(bus);  // last: it announces the key the others listen for
