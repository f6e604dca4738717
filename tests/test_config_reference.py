"""docs/configuration.md is what ``disagg config reference`` generates from the schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from disagg.config import reference

ROOT = Path(__file__).resolve().parents[1]


def test_checked_in_reference_is_generated():
    checked_in = (ROOT / "docs" / "configuration.md").read_text()
    assert checked_in == reference.markdown(), (
        f"docs/configuration.md is out of date with the schema; run: {reference.COMMAND}"
    )


def test_reference_command_prints_it():
    r = subprocess.run(
        [sys.executable, "-m", "disagg", "config", "reference"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0 and r.stdout == reference.markdown()


def test_every_field_is_documented():
    import msgspec.inspect as mi

    from disagg import tuning
    from disagg.config.errors import description

    for cls in [cls for _, cls in reference.SECTIONS] + [tuning.Tuning]:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        for f in info.fields:
            assert description(f), f"{cls.__name__}.{f.name} has no Meta(description=...)"


def test_tuning_table_names_every_variable():
    from disagg import tuning

    text = reference.markdown()
    for var in tuning.ENV.values():
        assert f"`{var}`:" in text
