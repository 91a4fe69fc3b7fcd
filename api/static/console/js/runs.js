// How a job is named in lists and legends: its run name (the suffix the user gave, else its base model
// and method), beside its id.

export const METHOD_NAMES = { supervised: "supervised", dpo: "DPO", reinforcement: "reinforcement" };

/** The job's method type (a job object without ``method`` is supervised). */
export function jobMethod(job) {
  return job?.method?.type ?? "supervised";
}

/** The name a person gave the run (``suffix``, else ``metadata.name``), else its base model and method. */
export function runName(job) {
  const given = job.suffix || job.metadata?.name;
  if (given) return given;
  const base = String(job.model ?? "").split("/").pop();
  return `${base} ${METHOD_NAMES[jobMethod(job)]}`;
}

/** A legend's or a list's label: the run's name and its id. */
export function runLabel(job) {
  return `${runName(job)} (${job.id})`;
}
