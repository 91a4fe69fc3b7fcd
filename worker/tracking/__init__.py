"""Tracking integrations: a job's metrics sent to its team's MLflow server or to W&B.

``spec`` is what a job asks for (the request's ``integrations``, OpenAI's shape, stored on the job
row); ``base`` runs the sinks on rank 0 of the job process, on a background thread fed by a bounded
queue, so that a slow or unreachable tracking server never blocks or fails the training; the sinks
are ``mlflow_sink`` and ``wandb_sink``. Nothing here is imported by the training library.
"""
