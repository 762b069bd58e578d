import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str) -> str:
    """Path of an executable; skip locally when missing, fail under CI=true."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed"
        if IN_CI:
            pytest.fail(msg + " (required under CI=true)")
        pytest.skip(msg)
    return path


def require_module(name: str):
    try:
        return __import__(name)
    except ImportError:
        if IN_CI:
            pytest.fail(f"python module {name} is not installed (required under CI=true)")
        pytest.skip(f"{name} not installed")
