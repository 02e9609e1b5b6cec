"""Launching torchrun: the launcher, loopback stores, per-rank logs, the processes of a launch, failure diagnosis."""
