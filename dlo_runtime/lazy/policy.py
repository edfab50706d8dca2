"""What a lazy pipeline may defer and what it reports: the checked pipeline
classes with their components' declared use order, and the per-component
report (the policy itself is the :mod:`dlo_runtime.lazy` doc)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CheckedPipeline:
    """A pipeline class checked for release and reload.

    Attributes:
        components: the components that may defer.
        use_order: the components in the order one call uses them; a
            component may appear more than once (img2img's VAE encodes, then
            decodes). A use (a call, a method, any load) moves the call to
            the next stage naming the component, and entering a stage
            releases every component whose last stage lies before it: the
            first call's release points, before any use was counted.
    """

    components: tuple[str, ...]
    use_order: tuple[str, ...]

    def last_stage(self, name: str) -> int | None:
        """Index of the last stage naming ``name`` (None: not declared)."""
        found = [i for i, st in enumerate(self.use_order) if st == name]
        return found[-1] if found else None

    def next_stage(self, name: str, current: int) -> int | None:
        """The first stage at or after ``current`` naming ``name`` (None:
        this use is not on the declared path)."""
        return next((i for i in range(current, len(self.use_order)) if self.use_order[i] == name), None)


#: Pipeline classes whose components were checked for release and reload
#: (no stage mutates them after load; no stage reads an attribute that needs
#: weights before their use), with the components that may defer and their
#: declared use order (read from the classes' ``__call__`` in diffusers
#: 0.42: ``encode_prompt`` runs CLIP, then T5; the transformer denoises; the
#: VAE decodes).
CHECKED_PIPELINES: dict[str, CheckedPipeline] = {
    "FluxPipeline": CheckedPipeline(("text_encoder", "text_encoder_2", "transformer", "vae"),
                                    ("text_encoder", "text_encoder_2", "transformer", "vae")),
    # The VAE encodes the input image before denoising and decodes after:
    # its last use is the decode, so it overlaps the transformer.
    "FluxImg2ImgPipeline": CheckedPipeline(("text_encoder", "text_encoder_2", "transformer", "vae"),
                                           ("text_encoder", "text_encoder_2", "vae", "transformer", "vae")),
}

DEFAULT_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "vae")

@dataclasses.dataclass
class ComponentReport:
    """One component of a :class:`LazyPipeline`.

    Attributes:
        name: the pipeline attribute (``"transformer"``).
        deferred: loaded on first use and released after its last use.
        why: why it is (or is not) deferred.
        plan: the load path: ``<outcome> (<placement>)`` of the last load.
        loads: completed loads (the first and every reload).
        load_seconds: wall seconds of each load, in order.
        bytes_materialized: private bytes each load allocated (0 on a warm
            reload).
        outcomes: the :func:`from_pretrained` outcome of each load.
        resident_bytes: tensor bytes the loaded component holds (its peak
            memory contribution while loaded: private plus mapped pages).
        uses_per_call: uses counted in the last completed call (the release
            point of the next one).
        unplanned_reloads: reloads inside a call after a release in the
            same call (declared or counted).
        release: the release point the next call uses.
        notes: anything worth a look.
    """

    name: str
    deferred: bool
    why: str
    plan: str = ""
    loads: int = 0
    load_seconds: list[float] = dataclasses.field(default_factory=list)
    bytes_materialized: list[int] = dataclasses.field(default_factory=list)
    outcomes: list[str] = dataclasses.field(default_factory=list)
    resident_bytes: int = 0
    uses_per_call: int | None = None
    unplanned_reloads: int = 0
    release: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
