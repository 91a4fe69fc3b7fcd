"""Fine-tuning jobs: spec, data validation, the training loop on the ZenFlow engine, checkpoints,
the job runner and the Celery worker.

Importing the package (and trainer.spec, trainer.data, trainer.models, trainer.worker,
trainer.reaper) does not import torch; the loop and the job runner's training do.
"""
