"""``disagg config check [FILE]``: validate a config and print it with the switches in force.

stdout: the normalised config (sizes in bytes, endpoints canonical, defaults filled in) as
YAML or JSON, its ``tuning:`` section holding the switches in force (the file's, overridden
by ``DISAGG_*`` variables). stderr: one line per set switch naming where it came from, then
``FILE: OK``. A bad file or a bad ``DISAGG_*`` value is one ``config error: ...`` line on
stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec

from .. import tuning
from .errors import ConfigError, inline
from .load import load_config

EXIT_USAGE = 2


def run(path: str | None, fmt: str = "yaml") -> int:
    try:
        cfg = load_config(path)
        tuning.install(cfg.tuning)
        in_force = tuning.current()  # a bad DISAGG_* value fails here, by name
        sources = tuning.sources()
    except (ConfigError, tuning.TuningError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    data = cfg.to_dict()
    switches: dict[str, Any] = json.loads(msgspec.json.encode(in_force))
    data.pop("tuning", None)
    if switches:
        data["tuning"] = switches
    if fmt == "json":
        print(json.dumps(data, indent=2))
    else:
        import yaml

        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    sys.stdout.flush()
    for name, (value, source) in sources.items():
        where = "the config file" if source == "config" else f"${source}"
        print(f"tuning.{name}: {inline(value)} (from {where})", file=sys.stderr)
    print(f"{cfg.source}: OK", file=sys.stderr)
    return 0
