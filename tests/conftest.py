import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# tests/harness.py is shared by every test folder (the folders are not packages).
sys.path.insert(0, str(Path(__file__).parent))

# Tests that load NIXL run in a pytest process of their own, after the rest of the session.
# NIXL brings a UCX of its own; with ucxx's UCX loaded in the same process (the UCX plane's
# tests), two copies of UCX share one address space: a UCX plane started after NIXL
# crashed in its progress loop, and a NIXL contract case run after the UCX planes hung
# past every per-test timeout (stuck in native code, where no timeout signal is handled).
# The child's whole run has a limit; faulthandler_timeout (pyproject) prints the stacks.
NIXL_CHILD_ENV = "DISAGG_TEST_NIXL_PROCESS"  # set (in that process): run them here, last
NIXL_LIMIT_S = 900  # the whole NIXL process; ~1 min on two cores
_nixl_ids = pytest.StashKey[list[str]]()


def pytest_collection_modifyitems(config, items):
    nixl = [i for i in items if i.get_closest_marker("nixl") is not None]
    if not nixl or len(nixl) == len(items):
        return
    if config.option.collectonly or os.environ.get(NIXL_CHILD_ENV):  # in this process: last
        items.sort(key=lambda i: i.get_closest_marker("nixl") is not None)
        return
    items[:] = [i for i in items if i.get_closest_marker("nixl") is None]
    config.stash[_nixl_ids] = [i.nodeid for i in nixl]


def pytest_sessionfinish(session, exitstatus):
    ids = session.config.stash.get(_nixl_ids, None)
    ran = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
    if not ids or not ran:
        return
    if session.shouldstop or session.shouldfail:
        return  # stopped at a failure (-x): the NIXL tests are not run either
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids]
    env = {**os.environ, NIXL_CHILD_ENV: "1"}
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(
            cmd,
            cwd=session.config.rootpath,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: a kill reaches what it started
        )
        try:
            rc = child.wait(NIXL_LIMIT_S)
            verdict = f"exit status {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc, verdict = 1, f"killed after {NIXL_LIMIT_S} s (hung: its output has the stacks)"
        out.seek(0)
        text = out.read()
    if report is not None:
        report.write("\n")  # the progress line has no end of line yet
        report.write_sep("=", f"{len(ids)} NIXL tests in a process of their own: {verdict}")
        report.write(text)
    if rc != 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
