"""Fine-tuning jobs, in two halves that change for different reasons.

The training job as a library (no Celery, no database): :mod:`trainer.spec` (what a job is),
:mod:`trainer.data` (JSONL validation and tokenization), :mod:`trainer.tokenizer`,
:mod:`trainer.models` (base models), :mod:`trainer.batching` (batches and the loss),
:mod:`trainer.lora`, :mod:`trainer.loop` (``run_training``, on the ZenFlow engine),
:mod:`trainer.checkpoint`, :mod:`trainer.events` (what a run reports) and :mod:`trainer.cli`
(``zenflow train``). The worker service around it, :mod:`trainer.worker`, takes jobs from the queue
and runs them from the database; it imports the library, never the reverse.

Importing the package, the spec, data and model modules, or the worker service does not import torch;
the loop's training does.
"""
