"""Checkpoint publication: the journaled commit, the one finalizer per run, LATEST, the manifests, readers that verify, garbage collection."""
