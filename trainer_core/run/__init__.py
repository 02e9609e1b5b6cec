"""Run plumbing beside the library: what one segment or export launch does, and the records it leaves.

The plan and input pre-flight (`plan`, `plan_size`, `validate`); the entry
points torchrun starts (`segment_main`, `export_main`) and a segment's steps
(`segment`, `steps`); export preparation (`export_prepare`) and the files a
checkpoint holds (`checkpoint_layout`, `manifest`); state between segments
(`state`), live progress (`progress`), process-group set-up (`distributed`),
rank-process hygiene (`process_boot`, `rank_process`) and fault injection for
tests (`faults`); `figures` (the named per-step sums reduced over logical
ranks), `records` (the result files rank 0 writes and the tasks read: one
schema across the process boundary) and `layout` (the run directory's paths).
Nothing is imported here, so a light importer pays only for the module it names.
"""
