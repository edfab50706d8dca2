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

The release policy (docs/pipelines.md):

- a *use* is a completed call of the component (``proxy(...)``) or of one of
  its public methods (``vae.decode(...)``; private housekeeping such as
  diffusers' ``_reset_stateful_cache`` is not a use); reads that only need the config
  (``config``, ``dtype``, ``device``, plain attributes the constructor set)
  are answered from a meta skeleton and load nothing;
- every call, the first one included, releases a component at its
  *declared* last use: the pipeline class declares the order in which a
  call uses its components in ``model_cpu_offload_seq``, the string
  diffusers' own ``enable_model_cpu_offload`` chains its hooks by
  (:func:`use_order_of`, :attr:`CheckedPipeline.use_order`; FLUX: CLIP, T5,
  transformer, VAE; SD3: CLIP, CLIP, T5, transformer, VAE; FLUX img2img,
  declared here because the string names its VAE once: CLIP, T5, VAE,
  transformer, VAE), a use moves
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
  the lease's read-only views, xxh3 of private bytes), whose other state
  changed (:mod:`dlo_runtime.lazy.state`: ``vae.enable_tiling()``, a
  swapped attention processor, fused projections), or that had an
  attribute set through its proxy is *refused for deferral*: it stays
  resident from then on, so it never comes back different, and the report
  says why.

Which components defer (:func:`dlo_runtime.lazy.policy.plan_components`):
by default every component the class's use order names that the folder
holds, less ``_exclude_from_cpu_offload`` and the components the caller
passes; a class that declares no order loads every component with its own
``from_pretrained`` and the report says so. An explicit ``components=``
that cannot be honoured (not a component of the class, absent from the
folder, passed too, excluded from offload, not a torch module, no order,
a skeleton that would load differently from the library) raises, naming
the component and why. Each decision is logged at INFO and reported.
"""

from dlo_runtime.lazy.build import lazy_pipeline
from dlo_runtime.lazy.pipeline import LazyPipeline
from dlo_runtime.lazy.policy import DECLARED_USE_ORDERS, CheckedPipeline, ComponentReport, use_order_of
from dlo_runtime.lazy.proxy import LazyComponent

__all__ = ["DECLARED_USE_ORDERS", "CheckedPipeline", "ComponentReport", "LazyComponent", "LazyPipeline",
           "lazy_pipeline", "use_order_of"]
