"""Run plumbing beside the library: what one segment or export launch does, and the records it leaves.

`figures` (the named per-step sums reduced over logical ranks), `records`
(the result files rank 0 writes and the tasks read: one schema across the
process boundary), `segment` (one segment launch in named steps). Nothing
is imported here, so a light importer pays only for the module it names.
"""
