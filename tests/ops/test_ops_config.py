"""Every config key's type and range is checked with a message naming the key
(and the file); command-line overrides merge with the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from p2pxfer.daemon import DaemonConfig
from p2pxfer.daemon._config import PeerAddress, parse_peer
from p2pxfer.errors import ConfigError, InvalidArgument


@pytest.mark.parametrize(("keys", "message"), [
    ({"log_level": "LOUD"}, "log_level must be one of"),
    ({"log_format": "xml"}, "log_format must be one of"),
    ({"node": 5}, "node must be a string, got 5"),
    ({"node": ""}, "node must not be empty"),
    ({"node": "n" * 256}, "node must be at most 255 characters, got 256"),
    ({"socket": ""}, "socket must not be empty"),
    ({"allowed_uids": ["root"]}, "allowed_uids must be a list of numeric uids"),
    ({"allowed_uids": [-1]}, "allowed_uids must be a list of numeric uids"),
    ({"allowed_uids": 1000}, "allowed_uids must be a list"),
    ({"max_frame": True}, "max_frame must be an integer, got True"),
    ({"max_frame": 100}, "max_frame must be >= 4096, got 100"),
    ({"max_frame": "16M"}, "max_frame must be an integer"),
    ({"peers": "node-b"}, "peers must be an array of tables"),
    ({"peers": [{"name": "b"}]}, "peers must be an array of tables"),
    ({"peers": [{"name": "b", "address": "nohost"}]}, "peer 'b' address"),
    ({"peers": [{"name": "b", "address": "h:1"}, {"name": "b", "address": "h:2"}]},
     "names listed twice"),
    ({"control": "7700"}, "control: '7700' is not host:port"),
    ({"metrics": "9464"}, "metrics: '9464' is not host:port"),
    ({"interfaces": "eth0"}, "interfaces must be a list of strings"),
    ({"interfaces": [1]}, "interfaces must be a list of strings"),
    ({"seeds": ["h:99999"]}, "seeds"),
    ({"etcd_ttl": 1.5}, "etcd_ttl must be an integer"),
    ({"write_timeout_s": 0}, "write_timeout_s must be a number of seconds > 0"),
    ({"write_timeout_s": "60"}, "write_timeout_s must be a number of seconds"),
    ({"write_timeout_s": True}, "write_timeout_s must be a number of seconds"),
    ({"rail_stall_s": -1}, "rail_stall_s must be a number of seconds > 0"),
    ({"provider": 3}, "provider must be a string"),
    ({"cluster_token": "a", "cluster_token_file": "/x"}, "not both"),
    ({"typo": 1}, "unknown config keys ['typo']"),
    ({"write_timeout_s": 0}, "write_timeout_s must be a number of seconds > 0, got 0"),
    ({"write_timeout_s": "5s"}, "write_timeout_s must be a number of seconds"),
    ({"write_timeout_s": True}, "write_timeout_s must be a number of seconds"),
    ({"rail_stall_s": -1}, "rail_stall_s must be a number of seconds > 0"),
    ({"write_timeout_s": float("inf")}, "write_timeout_s must be a number of seconds"),
    ({"delivery_complete": 1}, "delivery_complete must be true or false, got 1"),
])
def test_bad_key_named(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        DaemonConfig.from_dict(keys)


def test_write_deadline_and_delivery_reach_the_engine_config() -> None:
    cfg = DaemonConfig.from_dict({"write_timeout_s": 3, "delivery_complete": True})
    assert cfg.write_timeout_s == 3.0 and isinstance(cfg.write_timeout_s, float)
    assert cfg.delivery_complete is True
    assert DaemonConfig.from_dict({}).write_timeout_s == 60.0


def test_config_error_is_invalid_argument() -> None:
    # callers that caught InvalidArgument before keep working
    with pytest.raises(InvalidArgument):
        DaemonConfig.from_dict({"node": 5})


def test_good_values_kept() -> None:
    cfg = DaemonConfig.from_dict({"log_level": "debug", "log_format": "json",
                                  "metrics": "127.0.0.1:9464", "allowed_uids": [1000],
                                  "peers": [{"name": "b", "address": "127.0.0.1:7701"}]})
    assert cfg.log_level == "DEBUG"
    assert cfg.log_format == "json"
    assert cfg.metrics == "127.0.0.1:9464"
    assert cfg.allowed_uids == (1000,)
    assert cfg.peers == (PeerAddress("b", "127.0.0.1:7701"),)


def test_file_named_in_error(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('log_level = "LOUD"\n')
    with pytest.raises(ConfigError, match=f"config {path}: log_level"):
        DaemonConfig.from_toml(path)
    path.write_text("node = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        DaemonConfig.from_toml(path)
    with pytest.raises(ConfigError, match=r"cannot read config .*missing\.toml"):
        DaemonConfig.from_toml(tmp_path / "missing.toml")


def test_overrides_merge(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('node = "a"\ncluster_token = "inline"\n'
                    '[[peers]]\nname = "b"\naddress = "127.0.0.1:7701"\n')
    token = tmp_path / "token"
    token.write_text("from-file\n")
    cfg = DaemonConfig.load(path, node="z", peers=[parse_peer("c=127.0.0.1:7702")],
                            cluster_token_file=str(token))
    assert cfg.node == "z"
    assert [p.name for p in cfg.peers] == ["b", "c"]
    assert cfg.cluster_token == "from-file"
    assert DaemonConfig.load(None, node="solo").node == "solo"


def test_token_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read cluster_token_file .*nope"):
        DaemonConfig.from_dict({"cluster_token_file": str(tmp_path / "nope")})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        DaemonConfig.from_dict({"cluster_token_file": str(empty)})


@pytest.mark.parametrize("text", ["b", "=h:1", "b=nohost", "b=h:x"])
def test_peer_flag_rejected(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_peer(text)


def test_deploy_example_parses() -> None:
    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "deploy").glob("*.toml")):
        DaemonConfig.from_toml(path)
