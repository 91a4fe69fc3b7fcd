// The console's entry point: one event bus between the views, and the hash router.
//   key        the key was set (every view reloads)           models  GET /v1/models answered
//   files      GET /v1/files answered                         follow  open this job id (#/jobs/<id>)
//   job-finished  a followed job ended (models reload)        chat-model  chat with this model id
//   route      the hash changed: {view, id}                   side-by-side  {left, right} model ids
//   jobs       GET /v1/fine_tuning/jobs answered              refresh-files  list the files again

import { initCatalog } from "./catalog.js";
import { initChat } from "./chat.js";
import { initDataset } from "./dataset.js";
import { initFiles } from "./files.js";
import { initFollow } from "./follow.js";
import { initJobs } from "./jobs.js";
import { initKey } from "./key.js";
import { loadModels } from "./models.js";
import { initQuotas } from "./quotas.js";
import { initRouter } from "./router.js";

const bus = new EventTarget();
const router = initRouter(bus);
initFiles(bus);
initDataset(bus);
initJobs(bus);
initFollow(bus);
initChat(bus);
initCatalog(bus);
initQuotas(bus);
bus.addEventListener("job-finished", async () => {
  try {
    bus.dispatchEvent(new CustomEvent("models", { detail: await loadModels() }));
  } catch { /* the key section shows key problems */ }
});
router.start();  // show the view the address names
initKey(bus);  // last: it announces the key the others listen for
