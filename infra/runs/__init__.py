"""A run's own records in the store: its state bundles, the run lease, the ledger, the loss curve, the runs a store holds."""
