"""What every route relies on: settings, auth, dependencies, the error envelope, request guards and
limits, pagination, Prometheus."""
