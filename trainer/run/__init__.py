"""The training run: :func:`trainer.run.loop.run_training` over its set-up (``setup``), each
optimizer step (``step``) and what it writes (``outputs``, ``checkpoint``); a job on N ranks joins its
process group (``distributed``), started and supervised by ``launch``."""
