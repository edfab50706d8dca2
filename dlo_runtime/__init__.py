"""Layerwise offload (DLO) runtime fed from HWR leases."""
