"""End-to-end suites: whole runs under Prefect, several nodes, deployments, run-lease races, injected faults, the UI."""
