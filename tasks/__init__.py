"""Prefect tasks: thin typed wrappers over trainer_core and infra that record outcomes."""
