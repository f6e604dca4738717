"""disagg.config: every error names its field and the fix; YAML and TOML; env lookup order."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disagg import cli
from disagg.config import (
    ENV_VARS,
    ConfigError,
    ConsumerConfig,
    DisaggConfig,
    MetricsConfig,
    ProducerConfig,
    SecurityConfig,
    check_llm_api_options,
    find_config_path,
    load_config,
    parse_endpoint,
    parse_size,
    read_curve_key,
    trtllm_llm_api_options,
)

PRODUCER = {"role": "producer", "producer": {"store_size": "1GiB"}}
CONSUMER = {"role": "consumer", "consumer": {"producers": ["tcp://10.0.0.1:5557"]}}


def err(data: dict, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        DisaggConfig.from_dict(data, **kw)
    return info.value


def with_(base: dict, section: str, **values) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    out[section] = {**out.get(section, {}), **values}
    return out


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


# --------------------------------------------------------------------------- good configs


def test_producer_defaults():
    cfg = DisaggConfig.from_dict(PRODUCER)
    assert cfg.role == "producer" and cfg.transport == "tcp" and cfg.consumer is None
    p = cfg.producer
    assert isinstance(p, ProducerConfig) and cfg.section is p
    assert p.store_size == 1 << 30
    assert p.control == "tcp://127.0.0.1:0" and p.events is None
    assert p.store_device == "cpu"
    assert (p.lease_ttl_s, p.save_timeout_s, p.push_timeout_s) == (30.0, 30.0, 30.0)
    assert p.owner_dead_after_s == 15.0  # 3 x default heartbeat
    assert cfg.instance_id == f"producer-{os.uname().nodename}-{os.getpid()}"
    assert cfg.metrics == MetricsConfig(port=None) and cfg.security is None


def test_consumer_defaults():
    cfg = DisaggConfig.from_dict(CONSUMER)
    c = cfg.consumer
    assert isinstance(c, ConsumerConfig) and cfg.producer is None
    assert c.producers == ("tcp://10.0.0.1:5557",)
    assert c.data == "tcp://127.0.0.1:0" and c.load_mode == "auto"
    assert (c.claim_timeout_s, c.load_timeout_s, c.heartbeat_s, c.lease_ttl_s) == (1, 30, 5, 30)


def test_roundtrip_and_frozen():
    data = with_(
        CONSUMER, "consumer", load_mode="sync", producers=["ipc:///tmp/p", "tcp://[::1]:7"]
    )
    data["metrics"] = {"port": 9200}
    data["model_id"] = "m@1"
    cfg = DisaggConfig.from_dict(data)
    again = DisaggConfig.from_dict(cfg.to_dict())
    assert again == cfg
    json.dumps(cfg.to_dict())  # plain data
    with pytest.raises(AttributeError):
        cfg.role = "producer"  # type: ignore[misc]


def test_direct_construction_validates():
    assert ProducerConfig(store_size="512MiB").store_size == 512 << 20
    with pytest.raises(ConfigError, match=r"^producer\.lease_ttl_s"):
        ProducerConfig(store_size=1, lease_ttl_s=0)
    with pytest.raises(ConfigError, match=r"consumer\.producers"):
        ConsumerConfig(producers=())


@pytest.mark.parametrize(
    "text,expected",
    [
        (1048576, 1048576),
        ("1048576", 1048576),
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("512 mib", 512 << 20),
        ("64KiB", 64 << 10),
        ("1TiB", 1 << 40),
        ("1.5GiB", 3 << 29),
        ("100B", 100),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text, "x") == expected


@pytest.mark.parametrize("text", ["4GB", "4G", "4gb", "512MB", "512M", "64K", "1T"])
def test_parse_size_ambiguous(text):
    with pytest.raises(
        ConfigError, match="is ambiguous: write .*iB \\(binary\\) or \\d+ \\(bytes\\)"
    ):
        parse_size(text, "producer.store_size")


def test_store_size_ambiguous_message_exact():
    e = err(with_(PRODUCER, "producer", store_size="4GB"))
    assert "store_size '4GB' is ambiguous: write 4GiB (binary) or 4000000000 (bytes)" in str(e)
    assert e.field == "producer.store_size"


@pytest.mark.parametrize("text", ["", "lots", "4 GiBs", "4XB", -1, 0, "0", True, 1.5, "0.5B"])
def test_parse_size_bad(text):
    with pytest.raises(ConfigError, match=r"^producer\.store_size"):
        parse_size(text, "producer.store_size")


# --------------------------------------------------------------------------- errors


def test_missing_role():
    e = err({"producer": {"store_size": 1}})
    assert str(e).startswith("role:") and "producer" in str(e) and "consumer" in str(e)


def test_unknown_role_lists_valid():
    e = err({"role": "prefill"})
    assert str(e) == "role: unknown value 'prefill'; valid values: producer, consumer"


def test_unknown_role_suggests():
    assert "did you mean 'consumer'" in str(err({"role": "consumr"}))


def test_missing_store_size():
    e = err({"role": "producer", "producer": {}})
    assert e.field == "producer.store_size" and "4GiB" in str(e)


def test_missing_producer_section():
    e = err({"role": "producer"})
    assert e.field == "producer.store_size" and "producer:" in str(e)


def test_missing_producers():
    e = err({"role": "consumer", "consumer": {}})
    assert e.field == "consumer.producers" and "tcp://" in str(e)
    e = err({"role": "consumer"})
    assert e.field == "consumer.producers"


def test_empty_producers():
    e = err(with_(CONSUMER, "consumer", producers=[]))
    assert e.field == "consumer.producers" and "at least one" in str(e)


def test_wrong_section_for_role():
    data = dict(PRODUCER, consumer=CONSUMER["consumer"])
    e = err(data)
    assert e.field == "consumer" and "role is 'producer'" in str(e)


def test_kv_heads_and_tp_size_keys():
    cfg = DisaggConfig.from_dict(dict(CONSUMER, num_kv_heads=8, tensor_parallel_size=2))
    assert (cfg.num_kv_heads, cfg.tensor_parallel_size) == (8, 2)
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg
    assert "num_kv_heads" not in DisaggConfig.from_dict(CONSUMER).to_dict()  # null: left out
    for key in ("num_kv_heads", "tensor_parallel_size"):
        e = err(dict(PRODUCER, **{key: 0}))
        assert e.field == key and str(e).startswith(f"{key}: ") and "\n" not in str(e)
    e = err(dict(PRODUCER, num_kv_heads=4, tensor_parallel_size=3))
    assert e.field == "tensor_parallel_size"
    assert "3 neither divides num_kv_heads (4) nor is a multiple of it" in str(e)
    assert DisaggConfig.from_dict(dict(PRODUCER, num_kv_heads=2, tensor_parallel_size=8))


@pytest.mark.parametrize(
    "data,field,suggestion",
    [
        (dict(PRODUCER, transprt="tcp"), "transprt", "transport"),
        (with_(PRODUCER, "producer", store_sise="1GiB"), "producer.store_sise", "store_size"),
        (
            with_(CONSUMER, "consumer", claim_timout_s=1),
            "consumer.claim_timout_s",
            "claim_timeout_s",
        ),
        (dict(PRODUCER, metrics={"prot": 1}), "metrics.prot", "port"),
        (
            dict(PRODUCER, security={"allowed_client_key": []}),
            "security.allowed_client_key",
            "allowed_client_keys",
        ),
    ],
)
def test_unknown_key_suggests(data, field, suggestion):
    e = err(data)
    assert e.field == field
    assert f"did you mean '{suggestion}'?" in str(e)


def test_unknown_key_without_close_match_lists_valid():
    e = err(with_(PRODUCER, "producer", zzzzzz=1))
    assert e.field == "producer.zzzzzz" and "valid keys here:" in str(e) and "store_size" in str(e)


@pytest.mark.parametrize(
    "endpoint,fragment",
    [
        ("localhost:5557", "bad endpoint"),
        ("http://h:1", "scheme 'http'"),
        ("tcp://host", "host:port"),
        ("tcp://host:99999", "port '99999'"),
        ("tcp://host:abc", "port 'abc'"),
        ("tcp://:5", "not a valid host"),
        ("tcp://bad host:5", "not a valid host"),
        ("ipc://", "needs a path"),
        ("tcp://[zz]:5", "not an IPv6"),
    ],
)
def test_bad_bind_endpoint(endpoint, fragment):
    e = err(with_(PRODUCER, "producer", control=endpoint))
    assert e.field == "producer.control"
    assert repr(endpoint) in str(e) and fragment in str(e)


@pytest.mark.parametrize(
    "endpoint,fragment",
    [
        ("tcp://prefill-1", "host:port"),
        ("tcp://*:5557", "wildcard"),
        ("tcp://0.0.0.0:5557", "wildcard"),
        ("tcp://prefill:0", "port 0"),
        ("inproc://x", "scheme 'inproc'"),
        (5557, "bad endpoint"),
    ],
)
def test_bad_producer_entry_named(endpoint, fragment):
    e = err(with_(CONSUMER, "consumer", producers=["tcp://ok:1", endpoint]))
    assert e.field == "consumer.producers[1]" and fragment in str(e)


def test_duplicate_producers():
    e = err(with_(CONSUMER, "consumer", producers=["tcp://a:1", "tcp://a:1"]))
    assert e.field == "consumer.producers" and "twice" in str(e)


def test_good_endpoints():
    assert parse_endpoint("tcp://*:0", "f").port == 0
    assert parse_endpoint("tcp://[::1]:80", "f").url == "tcp://[::1]:80"
    assert parse_endpoint("ipc:///tmp/x.sock", "f").path == "/tmp/x.sock"
    assert parse_endpoint("inproc://a", "f").scheme == "inproc"
    cfg = DisaggConfig.from_dict(with_(PRODUCER, "producer", events="ipc:///tmp/ev"))
    assert cfg.producer is not None and cfg.producer.events == "ipc:///tmp/ev"


@pytest.mark.parametrize("value", [0, -1, "30", None, True, float("inf"), float("nan")])
@pytest.mark.parametrize(
    "section,base,key",
    [
        ("producer", PRODUCER, "lease_ttl_s"),
        ("producer", PRODUCER, "save_timeout_s"),
        ("producer", PRODUCER, "push_timeout_s"),
        ("producer", PRODUCER, "owner_dead_after_s"),
        ("producer", PRODUCER, "lease_max_hold_s"),
        ("consumer", CONSUMER, "claim_timeout_s"),
        ("consumer", CONSUMER, "load_timeout_s"),
        ("consumer", CONSUMER, "heartbeat_s"),
        ("consumer", CONSUMER, "lease_ttl_s"),
    ],
)
def test_timeouts_positive(section, base, key, value):
    if value is None and key == "owner_dead_after_s":
        return  # null means "default"
    e = err(with_(base, section, **{key: value}))
    assert e.field == f"{section}.{key}" and "> 0" in str(e)


def test_lease_max_hold_at_least_the_ttl():
    e = err(with_(PRODUCER, "producer", lease_ttl_s=60, lease_max_hold_s=30))
    assert e.field == "producer.lease_max_hold_s" and "lease_ttl_s" in str(e)
    cfg = DisaggConfig.from_dict(with_(PRODUCER, "producer", lease_max_hold_s=60))
    assert cfg.producer is not None and cfg.producer.lease_max_hold_s == 60


def test_heartbeat_shorter_than_lease():
    e = err(with_(CONSUMER, "consumer", heartbeat_s=30, lease_ttl_s=30))
    assert e.field == "consumer.heartbeat_s" and "lease_ttl_s" in str(e)


@pytest.mark.parametrize(
    "section,base,key,value",
    [
        ("producer", PRODUCER, "store_device", "gpu"),
        ("consumer", CONSUMER, "load_mode", "lazy"),
    ],
)
def test_bad_choices(section, base, key, value):
    e = err(with_(base, section, **{key: value}))
    assert e.field == f"{section}.{key}" and "valid values" in str(e)


def test_bad_transport():
    e = err(dict(PRODUCER, transport="rdma"))
    assert e.field == "transport" and "tcp, ucx, ipc" in str(e)


def test_transport_zmq_is_refused_naming_tcp():
    e = err(dict(PRODUCER, transport="zmq"))
    assert e.field == "transport"
    assert str(e) == (
        "transport: 'zmq' was renamed; use 'tcp' "
        "(plain TCP/Unix stream sockets; control stays on ZMQ)"
    )


def test_transport_checksum():
    assert DisaggConfig.from_dict(PRODUCER).transport_checksum is False
    cfg = DisaggConfig.from_dict(dict(CONSUMER, transport_checksum=True))
    assert cfg.transport_checksum is True
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg
    e = err(dict(PRODUCER, transport_checksum="yes"))
    assert e.field == "transport_checksum" and "true or false" in str(e)
    e = err(dict(PRODUCER, transport="ucx", transport_checksum=True))
    assert e.field == "transport_checksum" and "only the tcp" in str(e)


def test_ucx_channel_and_readers():
    cfg = DisaggConfig.from_dict(dict(CONSUMER, transport="ucx"))
    assert cfg.ucx_channel is None and cfg.ucx_rma_readers is None
    cfg = DisaggConfig.from_dict(
        dict(CONSUMER, transport="ucx", ucx_channel="shm", ucx_rma_readers=3)
    )
    assert (cfg.ucx_channel, cfg.ucx_rma_readers) == ("shm", 3)
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg
    # other transports refuse them, naming the fix
    for key, value in (("ucx_channel", "shm"), ("ucx_rma_readers", 2)):
        e = err(dict(PRODUCER, **{key: value}))
        assert e.field == key and "set transport: ucx" in str(e)
    e = err(dict(PRODUCER, transport="ucx", ucx_channel="rdma"))
    assert e.field == "ucx_channel" and "valid values" in str(e)
    for bad in (0, -1, True, "2", 1.5):
        e = err(dict(PRODUCER, transport="ucx", ucx_rma_readers=bad))
        assert e.field == "ucx_rma_readers" and "integer >= 1" in str(e)


def test_nixl_error_handling():
    cfg = DisaggConfig.from_dict(dict(CONSUMER, transport="nixl", nixl_error_handling="none"))
    assert cfg.nixl_error_handling == "none"
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg
    e = err(dict(PRODUCER, nixl_error_handling="none"))
    assert e.field == "nixl_error_handling" and "set transport: nixl" in str(e)
    e = err(dict(PRODUCER, transport="nixl", nixl_error_handling="off"))
    assert e.field == "nixl_error_handling" and "valid values" in str(e)


@pytest.mark.parametrize("port", [-1, 65536, "9100", True])
def test_bad_metrics_port(port):
    e = err(dict(PRODUCER, metrics={"port": port}))
    assert e.field == "metrics.port"


def test_section_not_mapping():
    e = err({"role": "producer", "producer": ["store_size"]})
    assert e.field == "producer" and "mapping" in str(e)


def test_top_level_not_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        DisaggConfig.from_dict(["role"])  # type: ignore[arg-type]


def test_instance_id_and_model_id():
    cfg = DisaggConfig.from_dict(dict(PRODUCER, instance_id="prefill-0", model_id="llama"))
    assert cfg.instance_id == "prefill-0" and cfg.model_id == "llama"
    assert err(dict(PRODUCER, instance_id="")).field == "instance_id"
    assert err(dict(PRODUCER, model_id=3)).field == "model_id"


# --------------------------------------------------------------------------- security


@pytest.fixture
def keys(tmp_path):
    a = cli.write_keypair("prefill", tmp_path)
    b = cli.write_keypair("decode", tmp_path)
    return tmp_path, a, b


def test_keys_command(tmp_path, capsys):
    assert cli.main(["keys", "node", "--dir", str(tmp_path)]) == 0
    secret, public = tmp_path / "node.key", tmp_path / "node.key.pub"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "secret-key" not in public.read_text()
    pub = read_curve_key(public, "public")
    assert read_curve_key(secret, "public") == pub and len(read_curve_key(secret, "secret")) == 40
    import zmq
    import zmq.auth

    assert zmq.auth.load_certificate(str(secret)) == (pub, read_curve_key(secret, "secret"))
    assert zmq.curve_public(read_curve_key(secret, "secret")) == pub
    # refuses to overwrite without --force
    assert cli.main(["keys", "node", "--dir", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main(["keys", "node", "--dir", str(tmp_path), "--force"]) == 0
    assert read_curve_key(public) != pub


def test_security_producer(keys):
    d, (psec, ppub), (_, dpub) = keys
    raw_key = read_curve_key(dpub).decode()
    data = dict(
        PRODUCER,
        security={
            "curve_secret_key_file": "prefill.key",  # relative to base_dir
            "curve_public_key_file": str(ppub),
            "allowed_client_keys": ["decode.key.pub", raw_key],
        },
    )
    cfg = DisaggConfig.from_dict(data, base_dir=d)
    sec = cfg.security
    assert isinstance(sec, SecurityConfig) and sec.enabled
    assert sec.curve_secret_key_file == str(psec)
    assert sec.secret_key() == read_curve_key(psec, "secret")
    assert sec.public_key() == read_curve_key(ppub)
    assert sec.client_keys() == [raw_key.encode()] * 2
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg


def test_security_consumer(keys):
    d, (psec, ppub), (dsec, dpub) = keys
    sec = {
        "curve_secret_key_file": str(dsec),
        "curve_public_key_file": str(dpub),
        "server_public_key": str(ppub),
    }
    cfg = DisaggConfig.from_dict(dict(CONSUMER, security=sec))
    assert cfg.security is not None and cfg.security.server_key() == read_curve_key(ppub)
    no_server = {k: v for k, v in sec.items() if k != "server_public_key"}
    assert err(dict(CONSUMER, security=no_server)).field == "security.server_public_key"
    e = err(dict(CONSUMER, security={**sec, "allowed_client_keys": [str(ppub)]}))
    assert e.field == "security.allowed_client_keys" and "producer setting" in str(e)


def test_security_errors(keys, tmp_path):
    d, (psec, ppub), _ = keys
    e = err(
        dict(
            PRODUCER,
            security={
                "curve_secret_key_file": str(d / "nope.key"),
                "curve_public_key_file": str(ppub),
            },
        )
    )
    assert e.field == "security.curve_secret_key_file" and "disagg keys" in str(e)
    e = err(dict(PRODUCER, security={"curve_secret_key_file": str(psec)}))
    assert e.field == "security.curve_public_key_file" and "both" in str(e)
    e = err(
        dict(
            PRODUCER,
            security={"curve_secret_key_file": str(ppub), "curve_public_key_file": str(ppub)},
        )
    )
    assert e.field == "security.curve_secret_key_file" and "secret-key" in str(e)
    e = err(
        dict(
            PRODUCER,
            security={
                "curve_secret_key_file": str(psec),
                "curve_public_key_file": str(ppub),
                "allowed_client_keys": ["not-a-key"],
            },
        )
    )
    assert e.field == "security.allowed_client_keys[0]"
    e = err(dict(PRODUCER, security={"allowed_client_keys": [str(ppub)]}))
    assert "no key pair" in str(e)
    junk = tmp_path / "junk.pub"
    junk.write_text("hello\n")
    e = err(
        dict(
            PRODUCER,
            security={"curve_secret_key_file": str(psec), "curve_public_key_file": str(junk)},
        )
    )
    assert e.field == "security.curve_public_key_file" and "Z85" in str(e)


# --------------------------------------------------------------------------- files and env


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


YAML_TEXT = """
role: consumer
instance_id: decode-0
consumer:
  producers: [tcp://prefill:5557, ipc:///tmp/p.sock]
  claim_timeout_s: 0.5
metrics:
  port: 9200
"""

TOML_TEXT = """
role = "consumer"
instance_id = "decode-0"

[consumer]
producers = ["tcp://prefill:5557", "ipc:///tmp/p.sock"]
claim_timeout_s = 0.5

[metrics]
port = 9200
"""


def test_yaml_and_toml_equal(tmp_path):
    a = load_config(write(tmp_path, "c.yaml", YAML_TEXT))
    b = load_config(write(tmp_path, "c.toml", TOML_TEXT))
    c = load_config(write(tmp_path, "c.yml", YAML_TEXT))
    assert a == b == c
    assert a.consumer is not None and a.consumer.claim_timeout_s == 0.5
    assert a.source == str(tmp_path / "c.yaml")


def test_toml_producer_sizes(tmp_path):
    text = '[producer]\nstore_size = "4GiB"\n'
    cfg = load_config(write(tmp_path, "p.toml", 'role = "producer"\n' + text))
    assert cfg.producer is not None and cfg.producer.store_size == 4 << 30
    with pytest.raises(ConfigError, match="is ambiguous"):
        load_config(write(tmp_path, "q.toml", 'role = "producer"\n[producer]\nstore_size = "4G"\n'))


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"\*\.yaml"):
        load_config(write(tmp_path, "c.json", "{}"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "bad.yaml", "role: [unclosed\n"))
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "bad.toml", "role = \n"))
    with pytest.raises(ConfigError, match="empty"):
        load_config(write(tmp_path, "empty.yaml", "# nothing\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "list.yaml", "- a\n"))


def test_file_error_names_file_and_field(tmp_path):
    p = write(tmp_path, "p.yaml", "role: producer\nproducer:\n  store_size: 4GB\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(info.value).startswith(str(p)) and info.value.field == "producer.store_size"


def test_env_lookup_order(tmp_path, monkeypatch):
    trt = write(tmp_path, "trt.yaml", "role: producer\nproducer: {store_size: 1MiB}\n")
    plain = write(tmp_path, "plain.yaml", YAML_TEXT)
    explicit = write(tmp_path, "explicit.toml", TOML_TEXT.replace("decode-0", "explicit"))
    with pytest.raises(ConfigError, match="TRTLLM_DISAGG_CONFIG"):
        load_config()
    monkeypatch.setenv("DISAGG_CONFIG", str(plain))
    assert load_config().instance_id == "decode-0"
    assert find_config_path() == (plain, "$DISAGG_CONFIG")
    monkeypatch.setenv("TRTLLM_DISAGG_CONFIG", str(trt))
    assert load_config().role == "producer"  # TRTLLM_ wins
    assert find_config_path() == (trt, "$TRTLLM_DISAGG_CONFIG")
    assert load_config(explicit).instance_id == "explicit"  # explicit path wins
    monkeypatch.setenv("TRTLLM_DISAGG_CONFIG", "")  # empty counts as unset
    assert load_config().instance_id == "decode-0"
    monkeypatch.setenv("TRTLLM_DISAGG_CONFIG", str(tmp_path / "gone.yaml"))
    with pytest.raises(ConfigError, match=r"\$TRTLLM_DISAGG_CONFIG.*not found"):
        load_config()


def test_relative_key_paths_resolve_against_file(tmp_path):
    cli.write_keypair("p", tmp_path / "keys")
    text = (
        "role: producer\nproducer: {store_size: 1MiB}\nsecurity:\n"
        "  curve_secret_key_file: keys/p.key\n  curve_public_key_file: keys/p.key.pub\n"
    )
    cfg = load_config(write(tmp_path, "p.yaml", text))
    assert cfg.security is not None
    assert cfg.security.curve_secret_key_file == str(tmp_path.resolve() / "keys/p.key")


# --------------------------------------------------------------------------- CLI


def test_config_check_cli(tmp_path, capsys):
    good = write(tmp_path, "c.yaml", YAML_TEXT)
    assert cli.main(["config", "check", str(good)]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["consumer"]["heartbeat_s"] == 5.0 and out["instance_id"] == "decode-0"
    assert cli.main(["config", "check", str(good), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["role"] == "consumer"
    bad = write(tmp_path, "b.yaml", "role: producer\nproducer: {store_size: 4G}\n")
    assert cli.main(["config", "check", str(bad)]) == 2
    assert "producer.store_size '4G' is ambiguous" in capsys.readouterr().err


def test_config_check_env(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRTLLM_DISAGG_CONFIG", str(write(tmp_path, "c.toml", TOML_TEXT)))
    assert cli.main(["config", "check"]) == 0
    assert "decode-0" in capsys.readouterr().out


def test_cli_missing_module_message(monkeypatch):
    def fake_import(name):
        raise ModuleNotFoundError(f"No module named '{name}'", name=name)

    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "transfer"])
    assert "disagg bench: not available" in str(info.value.code)


def test_cli_missing_dependency_message(monkeypatch):
    def fake_import(name):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    with pytest.raises(SystemExit) as info:
        cli.main(["demo"])
    assert "needs the Python package 'torch'" in str(info.value.code)
    assert "torch==2.13.0" in str(info.value.code)


def test_cli_delegates_args(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("disagg.serve")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "disagg.serve", fake)
    assert cli.main(["serve", "--role", "producer", "--port", "1"]) == 3
    assert seen["argv"] == ["--role", "producer", "--port", "1"]


def test_python_m_disagg():
    r = subprocess.run(
        [sys.executable, "-m", "disagg", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    for name in ("demo", "serve", "proxy", "bench", "keys", "config"):
        assert name in r.stdout


# --------------------------------------------------------------------------- trtllm options


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_trtllm_options_pass_own_check(role):
    assert check_llm_api_options(trtllm_llm_api_options(role)) == []


def test_check_llm_api_options_catches():
    bad = trtllm_llm_api_options("producer")
    bad["kv_cache_config"] = {"enable_block_reuse": False, "host_cache_size": 1 << 30}
    bad["cuda_graph_config"] = {"enable_padding": True}
    bad["max_beam_width"] = 4
    bad["speculative_config"] = {"decoding_type": "Eagle"}
    bad["pipeline_parallel_size"] = 2
    bad["kv_connector_config"] = {"connector": "lmcache", **bad["kv_connector_config"]}
    text = "\n".join(check_llm_api_options(bad))
    for fragment in (
        "enable_block_reuse",
        "host_cache_size",
        "cuda_graph_config",
        "max_beam_width",
        "speculative_config",
        "pipeline_parallel_size",
        "unexpected keys ['connector']",
    ):
        assert fragment in text


def test_pickled_copy_keeps_its_source(tmp_path):
    import pickle

    cfg = load_config(write(tmp_path, "c.yaml", YAML_TEXT))
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.source == cfg.source


@pytest.mark.parametrize(
    "data,field,fragment",
    [
        ({"role": 3}, "role", "valid values: producer, consumer"),
        (dict(PRODUCER, metrics={"host": "*"}), "metrics.host", "0.0.0.0"),
        (with_(PRODUCER, "producer", store_size=1.5), "producer.store_size", "4GiB"),
        (with_(CONSUMER, "consumer", producers=[[]]), "consumer.producers[0]", "rank order"),
        (
            with_(CONSUMER, "consumer", producers=[["tcp://a:1", "tcp://*:2"]]),
            "consumer.producers[0][1]",
            "wildcard",
        ),
        ({**PRODUCER, 1: 2}, "1", "keys must be strings"),
        (dict(PRODUCER, instance_id="  "), "instance_id", "non-empty string"),
        (dict(PRODUCER, transport="ipc", ipc_spin_us=1.5), "ipc_spin_us", "integer >= 0"),
    ],
)
def test_more_errors_name_their_field(data, field, fragment):
    e = err(data)
    assert e.field == field and str(e).startswith(f"{field}") and fragment in str(e)
    assert "\n" not in str(e)
