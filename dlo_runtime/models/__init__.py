"""Reference models for HWR. ``tiny_dit`` is the template DiT whose
final-layout contract lives in :mod:`dlo_runtime.contracts`."""

from dlo_runtime.models.tiny_dit import TinyDiT, TinyDiTConfig, write_checkpoint

__all__ = ["TinyDiT", "TinyDiTConfig", "write_checkpoint"]
