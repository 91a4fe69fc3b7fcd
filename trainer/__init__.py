"""Fine-tuning jobs, in two halves that change for different reasons.

The training job as a library (no Celery, no database): :mod:`trainer.spec` (what a job is),
:mod:`trainer.data.dataset` (JSONL validation and tokenization), :mod:`trainer.data.tokenizer`,
:mod:`trainer.model.catalog` (base models), :mod:`trainer.data.batching` (batches and the loss),
:mod:`trainer.model.lora`, :mod:`trainer.run.loop` (``run_training``, on the ZenFlow engine),
:mod:`trainer.run.checkpoint`, :mod:`trainer.events` (what a run reports) and :mod:`trainer.cli`
(``zenflow train``). The worker service around it, :mod:`worker`, takes jobs from the queue
and runs them from the database; it imports the library, never the reverse.

Importing the package, the spec, data and model modules, or the worker service does not import torch;
the loop's training does.
"""
