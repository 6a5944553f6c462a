"""The system libraries Mooncake's ``engine.so`` needs beyond its wheel, and which of them this host lacks.

``mooncake-transfer-engine-non-cuda`` bundles glog, gflags, yaml-cpp and jsoncpp, but links ``libibverbs``,
``libnl-3`` and ``libnl-route-3`` (and ``libnuma``) from the system even for TCP, so ``import mooncake.engine``
fails with a bare ``ImportError: libibverbs.so.1: cannot open shared object file`` where they are absent. The
plugin module checks them first (:func:`missing`) and fails with the library and the Debian package named.

``python -m kvcore_mooncake.syslibs`` prints the Debian packages to install, one per line (nothing when all are
present): what ``make install`` hands to ``apt-get install``.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["LIBRARIES", "missing", "describe_missing"]

#: soname -> the Debian (bookworm) package that provides it: what engine.so 0.3.13 links outside its wheel.
LIBRARIES: dict[str, str] = {
    "libibverbs.so.1": "libibverbs1",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
    "libnuma.so.1": "libnuma1",
}


def missing(libraries: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """``(soname, package, why)`` for each library the dynamic loader cannot load here (``dlopen``, as engine.so
    would be loaded; a present library stays loaded, which costs nothing the engine's import would not)."""
    out = []
    for soname, package in (LIBRARIES if libraries is None else libraries).items():
        try:
            ctypes.CDLL(soname)
        except OSError as exc:
            out.append((soname, package, str(exc)))
    return out


def describe_missing(absent: list[tuple[str, str, str]]) -> str:
    """One line naming every missing library, its package and the command that installs them."""
    names = ", ".join(f"{soname} (Debian package {package})" for soname, package, _ in absent)
    packages = " ".join(package for _, package, _ in absent)
    return (
        f"Mooncake's engine.so needs {names}, which the dynamic loader cannot load here "
        f"({absent[0][2]}); install: apt-get install -y {packages}  (or, as root, make install)"
    )


if __name__ == "__main__":
    print("\n".join(package for _, package, _ in missing()))
    sys.exit(0)
