"""The run lease: one run of a run id at a time, fencing, takeover of a crashed run, serve concurrency."""
