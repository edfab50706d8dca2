"""The contracts by name: what ``hwr prewarm --contract`` and the worker's
``--contract`` look up.

Apart from :mod:`dlo_runtime.contracts` because the shipped reference
contract (:mod:`dlo_runtime.models.tiny_dit_contract`) subclasses
:class:`~dlo_runtime.contracts.Contract`: the base module cannot import it
without an import circle, and this one sits above both.
"""

from __future__ import annotations

from dlo_runtime.contracts import Contract, GenericContract
from hwr_client.core.errors import InvalidArgument
from dlo_runtime.models.tiny_dit_contract import TinyDiTContract


_CONTRACTS: dict[str, Contract] = {}


def register_contract(contract: Contract) -> Contract:
    """Makes ``contract`` available by name (``hwr prewarm --contract``);
    a later registration of the same name replaces the earlier one."""
    _CONTRACTS[contract.name] = contract
    return contract


def _register_shipped() -> None:
    """Registers the contracts that ship, once, without replacing one a
    caller registered under the same name first."""
    for contract in (TinyDiTContract(), GenericContract()):
        _CONTRACTS.setdefault(contract.name, contract)


def get_contract(name: str) -> Contract:
    """The registered contract called ``name``.

    Raises:
        InvalidArgument: unknown name (the message lists the known ones).
    """
    _register_shipped()
    try:
        return _CONTRACTS[name]
    except KeyError:
        raise InvalidArgument(f"contract {name!r}: unknown; expected one of {sorted(_CONTRACTS)}") from None


def contract_names() -> list[str]:
    """Names of the registered contracts, sorted."""
    _register_shipped()
    return sorted(_CONTRACTS)
