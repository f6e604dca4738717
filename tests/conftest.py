import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# tests/harness.py is shared by every test folder (the folders are not packages).
sys.path.insert(0, str(Path(__file__).parent))

# Tests that load NIXL run last, in a pytest process of their own (one item here stands for
# them). NIXL brings a UCX of its own; with ucxx's UCX loaded in the same process (the UCX
# plane's tests), two copies of UCX share one address space: a UCX plane started after
# NIXL crashed in its progress loop, and a NIXL contract case run after the UCX planes hung
# past every per-test timeout (stuck in native code, where no timeout signal is handled).
# That process has a limit; faulthandler_timeout (pyproject) prints the stacks.
NIXL_CHILD_ENV = "DISAGG_TEST_NIXL_PROCESS"  # set (in that process): run them here, last
NIXL_LIMIT_S = 900  # the whole NIXL process; ~1 min on two cores


def _is_nixl(item: pytest.Item) -> bool:
    return item.get_closest_marker("nixl") is not None


def pytest_collection_modifyitems(config, items):
    nixl = [i for i in items if _is_nixl(i)]
    if not nixl or len(nixl) == len(items):
        return
    if config.option.collectonly or os.environ.get(NIXL_CHILD_ENV):  # in this process: last
        items.sort(key=_is_nixl)
        return
    items[:] = [i for i in items if not _is_nixl(i)]
    proc = NixlProcess.from_parent(
        nixl[0].getparent(pytest.Module), name="nixl_tests", ids=[i.nodeid for i in nixl]
    )
    proc.add_marker(pytest.mark.timeout(NIXL_LIMIT_S + 60))  # its own limit comes first
    items.append(proc)


class NixlProcessFailed(Exception):
    pass


class NixlProcess(pytest.Item):
    """The NIXL tests, run by node id in a pytest process of their own; fails with that
    process's output when it fails or outlives ``NIXL_LIMIT_S``."""

    def __init__(self, *, ids: list[str], **kw):
        super().__init__(**kw)
        self.ids = ids

    def runtest(self) -> None:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *self.ids]
        with tempfile.TemporaryFile("w+") as out:
            child = subprocess.Popen(
                cmd,
                cwd=self.config.rootpath,
                env={**os.environ, NIXL_CHILD_ENV: "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,  # a group of its own: a kill reaches what it started
            )
            try:
                rc = child.wait(NIXL_LIMIT_S)
                verdict = f"exit status {rc}"
            except subprocess.TimeoutExpired:
                rc, verdict = 1, f"killed after {NIXL_LIMIT_S} s (hung: the output has the stacks)"
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
            out.seek(0)
            text = out.read()
        if rc != 0:
            raise NixlProcessFailed(f"{len(self.ids)} NIXL tests: {verdict}\n{text}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, NixlProcessFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{len(self.ids)} NIXL tests in a process of their own"
