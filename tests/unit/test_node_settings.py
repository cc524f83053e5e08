"""This node's settings: every wait and transport knob is changed with `join --set
node.<name>=<value>`, listed with its unit and meaning by `lowcomm-node settings`; an unknown
name or a bad value is refused in one sentence before anything starts."""

import pytest

from node.cli import main
from node.config.schema import ConfigError
from node.config.settings import NodeSettings, apply_node_settings, node_settings


def test_node_settings_reach_the_daemons_waits_and_the_transport():
    settings = NodeSettings("d")
    apply_node_settings(settings, [("node.stall_s", 90), ("node.match_message_s", 20.5),
                                   ("node.parallel_streams", 8)])
    assert settings.transfer.stall_s == 90.0 and isinstance(settings.transfer.stall_s, float)
    assert settings.timeouts.match_message_s == 20.5 and settings.transfer.parallel_streams == 8


@pytest.mark.parametrize("override, sentence", [
    (("node.stal_s", 3), "unknown node setting 'node.stal_s': `lowcomm-node settings` lists them"),
    (("node.stall_s", "slow"), "node setting 'node.stall_s' must be a number, got 'slow'"),
    (("node.stall_s", 0), "node setting 'node.stall_s' must be positive, got 0"),
    (("node.parallel_streams", 2.5), "node setting 'node.parallel_streams' must be an integer, got 2.5"),
    (("node.stall_s", True), "node setting 'node.stall_s' must be a number, got True"),
    # the swarm's minimum link rate is the manifest's (protocol.min_link_mbit_s), not one node's
    (("node.min_rate_bytes_per_s", 1), "unknown node setting 'node.min_rate_bytes_per_s'"),
])
def test_an_unknown_name_or_a_bad_value_is_one_sentence(override, sentence):
    with pytest.raises(ConfigError) as refused:
        apply_node_settings(NodeSettings("d"), [override])
    assert str(refused.value).startswith(sentence)


def test_every_setting_is_listed_with_its_unit_and_meaning(capsys):
    names = [row[0] for row in node_settings()]
    assert {"node.stall_s", "node.open_timeout_s", "node.state_agreement_wait_s", "node.p2pd_start_s"} <= set(names)
    assert all(len(row[3]) > 10 for row in node_settings())
    assert main(["settings"]) == 0
    listing = capsys.readouterr().out
    for name in [*names, "protocol.min_link_mbit_s", "protocol.pair_deadline_s", "protocol.max_swap_rounds"]:
        assert name in listing


def test_join_refuses_a_bad_node_setting_before_starting(capsys):
    assert main(["join", "--swarm", "local", "--set", "node.stall_s=-1"]) == 2
    assert "node setting 'node.stall_s' must be positive, got -1" in capsys.readouterr().err
