"""Whole pipelines in small memory: components that load on first use,
release after their last use in a call, and reload warm from HWR.

A diffusers pipeline materializes every component before its first stage,
so its peak is the sum of the components although no two of FLUX's are
needed at once. :func:`lazy_pipeline` builds the real pipeline with
:class:`LazyComponent` proxies in place of the listed components. A proxy
loads its component through :func:`dlo_runtime.from_pretrained` (so through
HWR: the first load publishes, every reload is a ``LOCAL_HIT``, a lease and
views, nothing materialized) on first use, and the pipeline releases it
after its last use in a call. Peak memory becomes the largest set in use at
once.

The release policy (the README's "Lazy pipelines and host-weight plans"):

- a *use* is a completed call of the component (``proxy(...)``) or of one of
  its public methods (``vae.decode(...)``; private housekeeping such as
  diffusers' ``_reset_stateful_cache`` is not a use); reads that only need the config
  (``config``, ``dtype``, ``device``, plain attributes the constructor set)
  are answered from a meta skeleton and load nothing;
- every call, the first one included, releases a component at its
  *declared* last use: a checked class declares the order in which a call
  uses its components (:attr:`CheckedPipeline.use_order`; FLUX: CLIP, T5,
  transformer, VAE; img2img: CLIP, T5, VAE, transformer, VAE), a use moves
  the call to the next stage naming that component, and entering a stage
  releases every component whose last stage lies before it; so the first
  call (often the only one a short-lived worker serves) holds the largest
  set in use at once, not the sum;
- each call counts each component's uses; from the second call on, a
  component is also released right after the use that was its last one in
  the previous call (earlier than the declared point where the counts know
  more);
- a use after a release (the call took another path) reloads it, counted in
  ``unplanned_reloads`` and noted; a component whose declared release was
  too early drops it from the next call on and keeps only the counted one;
- every call, successful or not, releases what is still loaded on the way
  out; a failing release never replaces the exception being raised (it is
  logged and added to it as a note);
- a component whose tensors changed after load (bytes or data pointers,
  checked with :func:`dlo_runtime.restore.snapshot` at release: pointers for
  the lease's read-only views, xxh3 of private bytes) or that had an
  attribute set through its proxy is *refused for deferral*: it stays
  resident from then on, so it never comes back different, and the report
  says why.

Deferral is opt-in per pipeline class (:data:`CHECKED_PIPELINES`): only the
listed components of a checked class defer; an unchecked class loads every
component with its own ``from_pretrained`` and the report says so (the
seed's lesson: a stage that mutates a component or reads an attribute that
materializes it makes release unsafe or useless, so each class is checked
first).
"""

from dlo_runtime.lazy.pipeline import LazyPipeline, lazy_pipeline
from dlo_runtime.lazy.policy import CHECKED_PIPELINES, CheckedPipeline, ComponentReport
from dlo_runtime.lazy.proxy import LazyComponent

__all__ = ["CHECKED_PIPELINES", "CheckedPipeline", "ComponentReport", "LazyComponent", "LazyPipeline", "lazy_pipeline"]
