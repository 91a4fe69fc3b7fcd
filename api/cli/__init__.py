"""The ``zenflow`` command: ``main`` (serve, db, teams, keys; train and plan from the job library),
``storage`` and ``quotas``."""
