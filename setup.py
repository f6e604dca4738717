"""The compiled pieces: the block-key loops (disagg/protocol/_keyhash.c), the host row
copy of the same-host plane (disagg/transport/_rowcopy.c), the stream plane's scatter/
gather socket I/O (disagg/transport/_streamio.c) and the UCX plane's batched RMA posting
(disagg/transport/_ucxrma.c) and the receiver's one-pass batch check
(disagg/transport/_slotcheck.c). ``optional``: without a C compiler the install still
succeeds and each module falls back to a slower pure-Python path (keys.py, page_copy.py,
tcp/rowio.py; the UCX plane to its tag path). CI sets DISAGG_REQUIRE_NATIVE=1, under which
a missing extension is an error."""

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
        Extension("disagg.transport._ucxrma", ["disagg/transport/_ucxrma.c"], optional=True),
        Extension("disagg.transport._streamio", ["disagg/transport/_streamio.c"], optional=True),
        Extension("disagg.transport._slotcheck", ["disagg/transport/_slotcheck.c"], optional=True),
        Extension("disagg.transport._spin", ["disagg/transport/_spin.c"], optional=True),
    ]
)
