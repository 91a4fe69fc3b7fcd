"""What a worker can run: measured at its start, announced in the registry, checked against a job's plan."""
