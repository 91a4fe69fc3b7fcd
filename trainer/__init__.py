"""A fine-tuning job end to end, as a library: no Celery, no database, no Prometheus (the worker
service, :mod:`worker`, runs it from the queue; it imports this package, never the reverse).

- :mod:`trainer.spec` (a job's request with its files), :mod:`trainer.resolve` (the request decided:
  every ``auto`` and default, once), :mod:`trainer.limits` (the service's bounds of one job),
  :mod:`trainer.events` (what a run reports), :mod:`trainer.cli` (``zenflow train``);
- :mod:`trainer.method`: the fine-tuning methods (supervised, DPO), each its data, loss and metrics;
- :mod:`trainer.data`: the training data (JSONL validation and tokenization, the OpenAI chat format,
  the tokenizer, batches and the loss, packing);
- :mod:`trainer.model`: base models (the built-in catalogue and local folders, the folder checks, LoRA);
- :mod:`trainer.plan`: before a job runs, whether it fits a machine and how fast it will run;
- :mod:`trainer.run`: the run itself (the loop over set-up, steps and outputs, checkpoints,
  data-parallel ranks and their launch).

Importing the package, the spec, data and model modules does not import torch; the run's training does.
"""
