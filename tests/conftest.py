import sys
from pathlib import Path

# tests/harness.py is shared by every test folder (the folders are not packages).
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    """Tests that load NIXL into this process run last: NIXL brings a UCX of its own, and
    a UCX plane of ucxx's started after it in the same process can crash in UCX (seen as
    a segfault in the UCX plane's progress loop of a later contract case)."""
    items.sort(key=lambda item: item.get_closest_marker("nixl") is not None)
