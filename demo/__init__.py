"""``make run`` (``python -m demo``): the whole service on embedded defaults, end to end, on a laptop.

A few minutes. A client of the service: it starts ``zenflow serve`` and drives it with the openai SDK,
importing nothing of the API.

1. creates a team and an API key with the CLI, in the data folder every ``zenflow`` command uses
   (``ZENFLOW_DATA_DIR``, default ./var; the other ``ZENFLOW_*`` settings are kept too), so keys made
   with ``zenflow keys create`` work against ``--stay``'s server (:mod:`demo.folder`);
2. starts ``zenflow serve`` (API + in-process Celery worker on kombu's SQLAlchemy transport) on a free
   loopback port (:mod:`demo.server`);
3. with the official openai SDK: uploads the sample dataset, asks the base model (``docs-llama``, a small
   Llama pretrained on English docstrings, shipped in trainer/samples/models: trainer.samples.demo_base)
   the demo's questions, and creates a job on it (:mod:`demo.flow`);
4. follows the job's server-sent event stream to the end, printing each event (:mod:`demo.events`);
5. lists the checkpoints and the metrics, and how to download the model;
6. asks the fine-tuned model the same questions through the openai SDK (``chat.completions.create``,
   streamed), printing each answer before and after fine-tuning, and
   prints the console's URL; on a terminal it keeps serving until Ctrl-C so the console can be opened.

Exits non-zero when any step fails (the server's log tail is printed). The command line is
:mod:`demo.cli`.
"""
