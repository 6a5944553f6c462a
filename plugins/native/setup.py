"""kvcore-native's C extensions. Each opens its library (libzmq, libucp, NIXL's C API) at run time by path, so
the build needs gcc and the Python headers, plus the UCX headers of the libucx wheel for the UCX poster."""

import os

from setuptools import Extension, setup

ARGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
HERE = "src/kvcore_native"
HEADERS = [f"{HERE}/kvn_poster.h", f"{HERE}/kvn_zmq.h"]


def _ucx_include() -> list[str]:
    import libucx  # a build requirement (pyproject.toml): its headers only, nothing links to it

    return [os.path.join(os.path.dirname(libucx.__file__), "include")]


def _ext(name: str, **kw: object) -> Extension:
    return Extension(
        f"kvcore_native.{name}",
        sources=[f"{HERE}/{name}.c"],
        depends=HEADERS,
        extra_compile_args=ARGS,
        libraries=["dl", "pthread"],
        **kw,  # type: ignore[arg-type]
    )


setup(ext_modules=[_ext("_floor"), _ext("_lane"), _ext("_nixl"), _ext("_ucx", include_dirs=_ucx_include())])
