"""disagg.tuning: the DISAGG_* switches, the config's tuning: section, and where each
value in force came from (``disagg config check``)."""

from __future__ import annotations

import pytest
import yaml

from disagg import cli, tuning
from disagg.config import ConfigError, DisaggConfig, load_config

CONSUMER = {"role": "consumer", "consumer": {"producers": ["tcp://10.0.0.1:5557"]}}


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in tuning.ENV.values():
        monkeypatch.delenv(var, raising=False)
    yield
    tuning.install(tuning.Tuning())


def test_every_switch_has_its_variable():
    assert tuning.ENV["tp_hang_timeout_s"] == "DISAGG_TP_HANG_TIMEOUT_S"
    assert len(set(tuning.ENV.values())) == len(tuning.Tuning.__struct_fields__)


@pytest.mark.parametrize(
    "var,raw,value",
    [
        ("DISAGG_SPIN_US", "500", 500),
        ("DISAGG_SPIN_US", " 0 ", 0),
        ("DISAGG_STREAM_PIPE", "0", False),
        ("DISAGG_UCX_RMA", "1", True),
        ("DISAGG_IPC_PARTS", "2048, 4096", (2048, 4096)),
        ("DISAGG_TP_HANG_TIMEOUT_S", "2.5", 2.5),
        ("DISAGG_SPIN_US", "", None),  # empty: unset
    ],
)
def test_env_values(var, raw, value):
    name = next(n for n, v in tuning.ENV.items() if v == var)
    assert getattr(tuning.from_env({var: raw}), name) == value


@pytest.mark.parametrize(
    "var,raw,takes",
    [
        ("DISAGG_SPIN_US", "abc", "an integer >= 0"),
        ("DISAGG_SPIN_US", "-1", "an integer >= 0"),
        ("DISAGG_UCX_RMA_READERS", "0", "an integer >= 1"),
        ("DISAGG_STREAM_PIPE", "yes", "0 or 1"),
        ("DISAGG_IPC_PARTS", "4096,-1", "comma-separated page counts"),
        ("DISAGG_TP_HANG_TIMEOUT_S", "0", "> 0"),
        ("DISAGG_TP_HANG_TIMEOUT_S", "nan", "> 0"),
        ("DISAGG_TP_HANG_TIMEOUT_S", "inf", "> 0"),
    ],
)
def test_bad_env_value_names_the_variable(var, raw, takes):
    with pytest.raises(tuning.TuningError) as info:
        tuning.from_env({var: raw})
    assert str(info.value).startswith(f"{var}={raw!r}: expected ") and takes in str(info.value)


def test_install_current_and_sources(monkeypatch):
    tuning.install(tuning.Tuning(spin_us=100, ucx_rma=False))
    assert tuning.current().spin_us == 100
    monkeypatch.setenv("DISAGG_SPIN_US", "7")
    assert tuning.current().spin_us == 7 and tuning.current().ucx_rma is False
    assert tuning.sources() == {"spin_us": (7, "DISAGG_SPIN_US"), "ucx_rma": (False, "config")}
    monkeypatch.setenv("DISAGG_SPIN_US", "")  # empty counts as unset: the config's again
    assert tuning.sources()["spin_us"] == (100, "config")
    with pytest.raises(tuning.TuningError, match=r"^tuning\.spin_us=-1: expected an integer"):
        tuning.install(tuning.Tuning(spin_us=-1))


def test_config_section():
    cfg = DisaggConfig.from_dict({**CONSUMER, "tuning": {"spin_us": 250, "ipc_parts": [0]}})
    assert cfg.tuning == tuning.Tuning(spin_us=250, ipc_parts=(0,))
    assert cfg.to_dict()["tuning"] == {"spin_us": 250, "ipc_parts": [0]}
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg
    assert "tuning" not in DisaggConfig.from_dict(CONSUMER).to_dict()


@pytest.mark.parametrize(
    "section,field,fragment",
    [
        ({"spin_us": -1}, "tuning.spin_us", "integer >= 0"),
        ({"spinus": 1}, "tuning.spinus", "did you mean 'spin_us'?"),
        ({"ucx_rma": "off"}, "tuning.ucx_rma", "true, false or null"),
        ({"ipc_parts": [4096, -1]}, "tuning.ipc_parts[1]", "integer >= 0"),
        ({"tp_hang_timeout_s": 0}, "tuning.tp_hang_timeout_s", "> 0"),
    ],
)
def test_config_section_errors(section, field, fragment):
    with pytest.raises(ConfigError) as info:
        DisaggConfig.from_dict({**CONSUMER, "tuning": section})
    assert info.value.field == field and fragment in str(info.value)
    assert str(info.value).startswith(f"{field}: ")


def test_resolving_a_connector_config_installs_its_section():
    from types import SimpleNamespace

    from disagg.connector_common import resolve_config

    cfg = DisaggConfig.from_dict({**CONSUMER, "tuning": {"tp_hang_timeout_s": 9.0}})
    resolve_config(SimpleNamespace(disagg_config=cfg), "consumer")
    assert tuning.current().tp_hang_timeout_s == 9.0


def test_config_check_shows_switches_and_sources(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CONSUMER, "tuning": {"spin_us": 250, "ucx_rma": False}}))
    monkeypatch.setenv("DISAGG_SPIN_US", "500")
    assert cli.main(["config", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["tuning"] == {"spin_us": 500, "ucx_rma": False}
    assert "tuning.spin_us: 500 (from $DISAGG_SPIN_US)" in err
    assert "tuning.ucx_rma: false (from the config file)" in err
    assert load_config(path).tuning.spin_us == 250  # the file itself is unchanged


def test_config_check_bad_variable_is_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONSUMER))
    monkeypatch.setenv("DISAGG_UCX_RMA_READERS", "two")
    assert cli.main(["config", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert not out and err.splitlines() == [
        "config error: DISAGG_UCX_RMA_READERS='two': expected an integer >= 1"
    ]


def test_the_switch_interval_is_lowered_never_raised(monkeypatch):
    import sys

    from disagg.service_base import lower_switch_interval

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        lower_switch_interval()  # the default: 500 us
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        monkeypatch.setenv("DISAGG_GIL_SWITCH_US", "2000")
        lower_switch_interval()  # never raised
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(0.005)
        monkeypatch.setenv("DISAGG_GIL_SWITCH_US", "0")
        lower_switch_interval()  # 0: the interpreter's own
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
