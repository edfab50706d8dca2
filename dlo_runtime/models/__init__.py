"""Reference models for HWR. ``tiny_dit`` is the template DiT; its
final-layout contract lives beside it, in
:mod:`dlo_runtime.models.tiny_dit_contract`."""

from dlo_runtime.models.tiny_dit import TinyDiT, TinyDiTConfig, write_checkpoint

__all__ = ["TinyDiT", "TinyDiTConfig", "write_checkpoint"]
