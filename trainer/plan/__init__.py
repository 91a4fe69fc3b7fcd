"""The plan: before a job runs, whether it fits a machine, how fast it runs and what its ``auto``
settings become. :mod:`trainer.plan.planner` is the entry point (``plan_job``); ``shapes``, ``engine``
and ``speed`` count bytes and seconds, ``candidates`` and ``advice`` choose and explain, ``records``
holds what it returns, ``gpus`` the machines, ``in_run`` the plan inside a run, ``cli`` ``zenflow plan``."""
