"""The ``compile=`` switch: what a user may pass, checked before any work.

``compile=True`` is ``torch.compile(model)`` with its defaults (inductor);
a dict holds ``torch.compile``'s own keyword arguments: ``backend`` (a
name), ``mode``, ``fullgraph``, ``dynamic``, ``options`` (inductor's config
overrides). Everything in it is part of the compile artifact's key, so it
must be plain data: a callable backend or an option value that is not JSON
is refused (InvalidArgument), since no key could tell two of them apart.

Only the inductor backend leaves kernel caches behind; another backend
compiles as asked and the report says the artifact was bypassed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from hwr_client.core.errors import InvalidArgument

#: ``torch.compile`` keyword arguments ``compile=`` accepts.
COMPILE_KWARGS = frozenset({"backend", "mode", "fullgraph", "dynamic", "options"})
#: Backends whose caches a compile artifact holds.
CACHED_BACKENDS = frozenset({"inductor"})


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """A checked ``compile=`` value: ``torch.compile``'s arguments.

    ``options`` holds inductor config overrides as given (JSON values);
    :meth:`key_document` is their canonical form for the key.
    """

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def cached(self) -> bool:
        """True when the backend leaves caches a compile artifact can hold."""
        return self.backend in CACHED_BACKENDS

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``torch.compile``."""
        out: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options:
            out["options"] = dict(self.options)
        return out

    def key_document(self) -> dict[str, Any]:
        """The canonical JSON form (no floats: a float is ``{"float": repr}``)."""
        return {"backend": self.backend, "mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic,
                "options": {k: _canonical(v, f"compile options[{k!r}]") for k, v in sorted(self.options.items())}}


def _canonical(value: Any, where: str) -> Any:
    """``value`` as canonical JSON: floats spelled exactly (repr round-trips)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"{where}: {value!r}; expected a finite number")
        return {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise InvalidArgument(f"{where}: object keys must be strings")
        return {k: _canonical(v, f"{where}[{k!r}]") for k, v in sorted(value.items())}
    raise InvalidArgument(f"{where}: {type(value).__name__} is not plain data (JSON); a compile artifact's key "
                          "must be able to tell two settings apart")


def parse_compile(value: Any, *, what: str = "compile") -> CompileSettings | None:
    """Checks a ``compile=`` value.

    Args:
        value: False / None (no compile), True (``torch.compile`` defaults),
            a dict of ``torch.compile`` keyword arguments, or settings
            already checked.
        what: names the argument in errors.

    Returns:
        The settings, or None when compiling is off.

    Raises:
        InvalidArgument: an unknown key, a wrong type, a callable backend,
            ``mode`` together with ``options`` (torch.compile refuses both).
    """
    if value is None or value is False:
        return None
    if isinstance(value, CompileSettings):
        return value
    if value is True:
        return CompileSettings()
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{what}={value!r}: expected True, False or a dict of torch.compile arguments "
                              f"({', '.join(sorted(COMPILE_KWARGS))})")
    unknown = set(value) - COMPILE_KWARGS
    if unknown:
        raise InvalidArgument(f"{what}: unknown torch.compile argument(s) {sorted(map(str, unknown))}; expected "
                              f"some of {sorted(COMPILE_KWARGS)}")
    backend = value.get("backend", "inductor")
    if not isinstance(backend, str) or not backend:
        raise InvalidArgument(f"{what}['backend']: {backend!r}; expected a backend name (a callable backend has "
                              "no key a compile artifact could be stored under)")
    mode = value.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise InvalidArgument(f"{what}['mode']: {mode!r}; expected a string or None")
    fullgraph = value.get("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise InvalidArgument(f"{what}['fullgraph']: {fullgraph!r}; expected a bool")
    dynamic = value.get("dynamic")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise InvalidArgument(f"{what}['dynamic']: {dynamic!r}; expected True, False or None")
    options = value.get("options") or {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise InvalidArgument(f"{what}['options']: expected a dict of inductor config names to values")
    if mode is not None and options:
        raise InvalidArgument(f"{what}: give 'mode' or 'options', not both (torch.compile refuses both)")
    settings = CompileSettings(backend, mode, fullgraph, dynamic, dict(options))
    settings.key_document()  # refuses what has no canonical form, now rather than at the first call
    return settings


def per_component(value: Any, components: Sequence[str], *, what: str = "compile") -> dict[str, CompileSettings]:
    """The ``compile=`` of a lazy pipeline: settings per component.

    ``True`` or a dict of ``torch.compile`` arguments applies to every
    component in ``components``; a dict whose keys are all component names
    gives each its own value (``{"transformer": True}``). A dict that mixes
    the two is refused: its meaning would be a guess.

    Raises:
        InvalidArgument: a mixed dict, a component not in ``components``, or
            a value :func:`parse_compile` refuses.
    """
    if isinstance(value, Mapping) and value and not set(value) <= COMPILE_KWARGS:
        names = set(map(str, value))
        if names & COMPILE_KWARGS:
            raise InvalidArgument(f"{what}: {sorted(names)} mixes torch.compile arguments and component names; "
                                  "give {component: True | {...}} or the arguments alone")
        unknown = names - set(components)
        if unknown:
            raise InvalidArgument(f"{what}: component(s) {sorted(unknown)} are not loaded lazily here; expected "
                                  f"some of {sorted(components)}")
        out = {name: parse_compile(v, what=f"{what}[{name!r}]") for name, v in value.items()}
        return {k: v for k, v in out.items() if v is not None}
    settings = parse_compile(value, what=what)
    return {} if settings is None else dict.fromkeys(components, settings)


__all__ = ["CACHED_BACKENDS", "COMPILE_KWARGS", "CompileSettings", "parse_compile", "per_component"]
