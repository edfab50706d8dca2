"""The canonical key mapping: which checkpoint key fills which tensor of
the model, decided once per start, before any daemon call, from the shard
headers and the meta skeleton. The identity (its digest), the canonical
load and hence publication all read this one :class:`KeyPlan`.

The rules are the library's, asked of the library itself where it exposes
them, so a checkpoint loads into the same tensors as the library's own
``from_pretrained``:

- **transformers 5**: every key goes through the model's conversion mapping
  (``conversion_mapping.get_model_conversion_mapping``: per-model renames
  and the legacy ones, ``LayerNorm.gamma`` -> ``LayerNorm.weight``) and
  ``core_model_loading.rename_source_key``, which also adds or strips the
  ``base_model_prefix`` (a ``BertForSequenceClassification`` checkpoint
  into ``BertModel``, a ``LlamaModel`` one into ``LlamaForCausalLM``). Keys
  that fill nothing are dropped; the model's
  ``_adjust_missing_and_unexpected_keys`` says which of them the library
  drops silently (``_keys_to_ignore_on_load_unexpected``, old persistent
  ``position_ids`` and ``rotary_emb.inv_freq`` buffers) and the rest it
  drops with a warning (so does this, and the report notes them).
- **diffusers 0.42**: a single-file checkpoint goes through the model's
  ``_fix_state_dict_keys_on_load`` (deprecated attention-block names); a
  sharded one is read as is (the library's own rule). Unexpected keys are
  dropped, silently when ``_keys_to_ignore_on_load_unexpected`` matches.
- **tied weights**: one tensor, several names; any present name fills it
  (the library swaps source and target when only the target is saved).

What the plan refuses (:attr:`KeyPlan.ineligible`; the start then loads
with the library in preferred mode, and fails in required mode):

- a model tensor no checkpoint key fills: the library initializes it
  (a fresh head, a key on ``_keys_to_ignore_on_load_missing``). Its bytes
  then come from a random draw, not from the identity's sources, so
  publishing them would freeze one draw under a key that claims to be the
  checkpoint's, and two nodes would publish different bytes under one key;
- a transformers ``WeightConverter`` that matches (MoE expert merges, QKV
  splits): a byte-changing step of the library's loader;
- two checkpoint keys for one tensor, or tied names saved with different
  values (the library unties them: another model structure).

A shape mismatch is an error in every mode (:attr:`KeyPlan.errors`): the
library raises too.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
import types
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from dlo_runtime.pretrained.files import ModelFiles
from dlo_runtime.pretrained.weights import WeightEntry, WeightReader, open_weights, peek_entries, short

#: How many names a reason lists.
_SHOW = 5


@dataclasses.dataclass(frozen=True)
class KeyPlan:
    """Which checkpoint key fills which model tensor.

    Attributes:
        sources: model tensor name (each tensor once, by its first name) ->
            checkpoint key.
        renamed: ``(checkpoint key, model name)`` where they differ, sorted.
        ignored: checkpoint keys the library drops without a word.
        unused: checkpoint keys the library drops with a warning.
        ineligible: why HWR does not load this checkpoint (empty: it does).
        errors: what the library refuses too (shape mismatches).
    """

    sources: Mapping[str, str]
    renamed: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    ineligible: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    def digest(self) -> str:
        """``sha256:<hex>`` of the renames ("" when every key is its model
        name): part of the identity, so a change in how keys map changes
        the key even where the versions in the producer do not."""
        if not self.renamed:
            return ""
        text = json.dumps([list(p) for p in self.renamed], separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class KeyRules(Protocol):
    """One library's key rules for one model."""

    def rename(self, key: str) -> tuple[str, str | None]:
        """The model name a checkpoint key loads into, and the pattern of
        the byte-changing converter that matched it (None: a pure rename)."""

    def silently_ignored(self, names: set[str]) -> set[str]:
        """Which of ``names`` (keys that fill nothing) the library drops
        without a warning."""


class _TransformersRules:
    def __init__(self, model: Any, state: Mapping[str, torch.Tensor]):  # a transformers PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model, None, None)
        self._renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self._converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self._rename_source_key = rename_source_key
        self._model = model
        self._meta = state
        self._prefix = model.base_model_prefix

    def rename(self, key: str) -> tuple[str, str | None]:
        name, pattern = self._rename_source_key(key, self._renamings, self._converters, self._prefix, self._meta)
        if name not in self._meta and key in self._meta:
            # As the library: a key already right must not be renamed away (only the prefix may change).
            name, pattern = self._rename_source_key(key, [], [], base_model_prefix=self._prefix,
                                                    meta_state_dict=self._meta)
        return name, pattern

    def silently_ignored(self, names: set[str]) -> set[str]:
        # The library's own filter on a record with only the two fields it touches.
        info = types.SimpleNamespace(missing_keys=set(), unexpected_keys=set(names))
        self._model._adjust_missing_and_unexpected_keys(info)
        return set(names) - set(info.unexpected_keys)


class _DiffusersRules:
    def __init__(self, model: Any, keys: list[str], *, sharded: bool):  # a diffusers ModelMixin
        self._renames: dict[str, str] = {}
        if not sharded:
            # The library renames a single file's state dict in place; a
            # dict of names shows what it did without touching a byte.
            names: collections.OrderedDict[str, Any] = collections.OrderedDict((k, k) for k in keys)
            model._fix_state_dict_keys_on_load(names)
            self._renames = {orig: new for new, orig in names.items() if orig != new}
        self._patterns = list(type(model)._keys_to_ignore_on_load_unexpected or [])

    def rename(self, key: str) -> tuple[str, str | None]:
        return self._renames.get(key, key), None

    def silently_ignored(self, names: set[str]) -> set[str]:
        return {n for n in names if any(re.search(p, n) for p in self._patterns)}


def rules_for(model: nn.Module, files: ModelFiles, keys: list[str], state: Mapping[str, torch.Tensor]) -> KeyRules:
    """The library's rules for ``model`` loading ``files`` (``state``: its
    persistent names, what the library calls the meta state dict)."""
    if files.library == "transformers":
        return _TransformersRules(model, state)
    return _DiffusersRules(model, keys, sharded=files.sharded)


def plan_keys(model: nn.Module, files: ModelFiles, what: str) -> KeyPlan:
    """The key plan for loading ``files`` into ``model`` (an unfused meta
    skeleton), read from the headers (a ``.bin`` from its pickle); tied
    names both present are compared by value, the only bytes read.

    Args:
        what: the contract's name, for messages.
    """
    entries = peek_entries(files.weights, files.format)
    state, slots = persistent_tensors(model)
    rules = rules_for(model, files, sorted(entries), state)
    readers: list[WeightReader] = []

    def read(key: str) -> torch.Tensor:
        if not readers:
            readers.append(open_weights(files.weights, files.format, mmap=True))
        return readers[0].take(key)

    try:
        return _plan(state, slots, files, entries, rules, what, read)
    finally:
        for r in readers:
            r.close()


def persistent_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """Every persistent name -> tensor (``state_dict``'s names, tied aliases
    included) and each distinct tensor under its first name, in one walk in
    ``state_dict`` / :func:`~dlo_runtime.restore.tensor_slots` order (the
    warm path runs it: one walk instead of both)."""
    state: dict[str, torch.Tensor] = {}
    slots: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for owner_name, owner in model.named_modules(remove_duplicate=False):
        prefix = owner_name + "." if owner_name else ""
        skip = owner._non_persistent_buffers_set
        for table, persistent_only in ((owner._parameters, False), (owner._buffers, True)):
            for attr, t in table.items():
                if t is None or (persistent_only and attr in skip):
                    continue
                state[prefix + attr] = t
                if id(t) not in seen:
                    seen.add(id(t))
                    slots.append((prefix + attr, t))
    return state, slots


def _plan(state: Mapping[str, torch.Tensor], slots: list[tuple[str, torch.Tensor]], files: ModelFiles,
          entries: Mapping[str, WeightEntry], rules: KeyRules, what: str,
          read: Callable[[str], torch.Tensor]) -> KeyPlan:
    target: dict[str, str] = {}
    converted: dict[str, list[str]] = collections.defaultdict(list)  # converter pattern -> checkpoint keys
    leftover: set[str] = set()
    by_converter: set[str] = set()
    twice: list[str] = []
    for key in sorted(entries):
        name, converter = rules.rename(key)
        if name not in state:
            leftover.add(name)
        elif converter is not None:
            converted[converter].append(key)
            by_converter.add(name)  # filled, by a step HWR does not run: not "missing"
        elif name in target:
            twice.append(f"{target[name]!r} and {key!r} -> {name!r}")
        else:
            target[name] = key
    ineligible: list[str] = []
    if converted:
        keys = [k for ks in converted.values() for k in ks]
        ineligible.append(f"{len(keys)} checkpoint key(s) go through the library's converters {sorted(converted)} "
                          f"(e.g. {keys[0]!r}): a byte-changing load step HWR does not run")
    if twice:
        ineligible.append(f"checkpoint keys load into one tensor twice: {', '.join(twice[:_SHOW])}")
    names_of: dict[int, list[str]] = collections.defaultdict(list)
    for n, t in state.items():
        names_of[id(t)].append(n)
    sources: dict[str, str] = {}
    missing: list[str] = []
    errors: list[str] = []
    for slot, tensor in slots:
        names = names_of.get(id(tensor), [slot])
        present = [n for n in names if n in target]
        if not present and any(n in by_converter for n in names):
            continue
        if not present:
            missing.append(f"{slot!r} {list(tensor.shape)}")
            continue
        key = target[slot] if slot in present else target[present[0]]
        e = entries[key]
        if e.shape != tuple(tensor.shape):
            errors.append(f"{short(files.weights[e.file])}: {key!r} has shape {list(e.shape)}, {what} expects "
                          f"{list(tensor.shape)}")
        elif len(present) > 1 and not _tied_equal([target[n] for n in present], read, tensor.dtype):
            ineligible.append(f"{present} are tied in {what} but the checkpoint holds different values "
                              "(the library unties them)")
        sources[slot] = key
    if missing:
        ineligible.insert(0, f"the checkpoint lacks {len(missing)} tensor(s) of {what} that the library would "
                             f"initialize freshly (e.g. {', '.join(missing[:_SHOW])}); HWR publishes only tensors "
                             "the checkpoint determines")
    quiet = rules.silently_ignored(leftover) if leftover else set()
    renamed = tuple(sorted((k, n) for n, k in target.items() if k != n))
    return KeyPlan(sources, renamed, tuple(sorted(quiet)), tuple(sorted(leftover - quiet)), tuple(ineligible),
                   tuple(errors))


def _tied_equal(keys: list[str], read: Callable[[str], torch.Tensor], dtype: torch.dtype) -> bool:
    # Compared as loaded (cast to the runtime dtype), as the library compares the loaded parameters.
    first = read(keys[0]).to(dtype)
    return all(torch.equal(first, read(k).to(dtype)) for k in keys[1:])
