"""The plan: before a job runs, whether it fits a machine, how fast it runs and the settings it leaves
to the plan. :mod:`trainer.plan.planner` is the entry point (``plan_job`` of a
:class:`~trainer.plan.query.PlanQuery`, which :mod:`trainer.resolve` makes of a job); ``shapes``,
``engine`` and ``speed`` count bytes and seconds, ``candidates`` and ``advice`` choose and explain,
``records`` holds what it returns, ``gpus`` the machines, ``cli`` ``zenflow plan``."""
