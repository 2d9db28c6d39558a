"""Fixtures shared by the kernel tests: the native operator set and the torch reference."""

from __future__ import annotations

import pytest

from libs.engine.kernels import TorchOps


@pytest.fixture(scope="session")
def native():
    """The native C++ operator set (tests using it skip when the kernels did not build)."""
    from libs.engine.kernels.native import NativeOps

    return NativeOps()


@pytest.fixture(scope="session")
def ref():
    return TorchOps()
