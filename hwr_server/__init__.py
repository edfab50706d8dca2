"""The HWR node daemon (``hwr serve``): store, publication, source digests,
leases, GC, admin. It alone writes under the store root."""
