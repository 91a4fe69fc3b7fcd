"""The job process the worker task starts: ``python -m worker.job.runner JOB_ID``."""
