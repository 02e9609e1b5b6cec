"""Prefect flows: the pipeline as a person reads it, its deployments and the CLI."""
