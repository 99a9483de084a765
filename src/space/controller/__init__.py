"""Reconcile loops over the database: placement, state changes, timeouts, worker health, GC."""
