"""The compiled pieces: the block-key loops (disagg/protocol/_keyhash.c) and the host row
copy of the same-host plane (disagg/transport/_rowcopy.c). ``optional``: without a C
compiler the install still succeeds; keys.py computes the same keys in pure Python and
page_copy.py copies with torch/numpy in two passes, only slower."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("disagg.protocol._keyhash", ["disagg/protocol/_keyhash.c"], optional=True),
        Extension(
            "disagg.transport._rowcopy",
            ["disagg/transport/_rowcopy.c"],
            extra_compile_args=["-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
