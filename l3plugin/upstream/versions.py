"""Upstream versions as l3plugin's patch sets see them (l3plugin/upstream/patchset.py): the version of a module as
IMPORTED (a Megatron-LM checkout first on PYTHONPATH wins over pip's megatron-core, whatever pip's metadata
says), read once per process, pip-style version ranges, and the ranges l3plugin's patch sets were checked on.
Imports nothing upstream until asked."""

from __future__ import annotations

import importlib
import os
from typing import NamedTuple

# The upstream releases l3plugin's patch sets are checked on (each set declares one of these as ``checked``).
# DeepSpeed: the latest patch of each minor release from 0.16 to 0.19 was run (compat/deepspeed.sh; docs/verified.md).
DEEPSPEED_CHECKED = ">=0.16.9,<0.20"
# Megatron-Core releases every Megatron set was checked on (docs/verified.md; pyproject.toml says the same).
MEGATRON_CHECKED = ">=0.16.1,<0.20"


def installed_version(package: str) -> str:
    """What pip's metadata says (may differ from what is imported: see ``imported_version``)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


class Imported(NamedTuple):
    """An upstream module as imported: its version ("" if it cannot be imported), its directory, or why not."""

    version: str
    path: str
    error: str = ""

    def __str__(self):
        return f"{self.version} (imported from {self.path})" if self.version else f"not importable ({self.error})"


def imported_version(module: str) -> Imported:
    """The version of ``module`` as imported, read once per process from the module itself (``__version__``;
    pip's metadata of the distribution only when the module has none)."""
    if module not in _IMPORTED:
        try:
            loaded = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - a broken upstream is reported, not raised, here
            return Imported("", "", f"{type(exc).__name__}: {exc}")
        version = getattr(loaded, "__version__", None)
        if not isinstance(version, str):
            version = installed_version(module.split(".")[0].replace("_", "-"))
        path = os.path.dirname(getattr(loaded, "__file__", None) or "") or "?"
        _IMPORTED[module] = Imported(str(version), path)
    return _IMPORTED[module]


def version_in(version: str, versions: str) -> bool:
    """Whether ``version`` ("0.19.1+abc1234": a local label is ignored) is in ``versions`` (a pip-style
    range ">=0.16.1,<0.20", or one version "0.19.8"); a version that is not PEP 440 is in no range."""
    from packaging.version import InvalidVersion, Version

    try:
        return version_range(versions).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def version_range(versions: str):
    """``versions`` as a packaging SpecifierSet (one version "0.19.8" means "==0.19.8"); a ValueError naming
    the text if it is not a pip-style range."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(f"=={versions}" if versions[:1].isdigit() else versions)
    except InvalidSpecifier:
        raise ValueError(f"versions {versions!r} is not a pip-style range (e.g. '>=0.16.1,<0.20', '<0.18') or "
                         f"one version (e.g. '0.19.8')") from None


_IMPORTED: dict[str, Imported] = {}  # module name -> its version as imported, read once per process
