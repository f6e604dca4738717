"""The one compiled piece: the block-key loops (disagg/protocol/_keyhash.c). ``optional``:
without a C compiler the install still succeeds and keys.py computes the same keys in pure
Python, only slower (see keys.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("disagg.protocol._keyhash", ["disagg/protocol/_keyhash.c"], optional=True)
    ]
)
