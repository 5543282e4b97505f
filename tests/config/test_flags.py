"""The sampling flags: defined once in config.flags, meaning the same in every subcommand."""

from __future__ import annotations

import dataclasses

import pytest

from hfsampler.cli.main import build_parser
from hfsampler.cli.record import options
from hfsampler.config.flags import FLAGGED, FLAGS, config_from_args
from hfsampler.config.settings import Config
from hfsampler.errors import ConfigError


def test_every_keyed_flag_names_a_config_field() -> None:
    fields = {f.name for f in dataclasses.fields(Config)}
    assert {k.field for _, k in FLAGGED} <= fields
    assert len({f.name for f in FLAGS}) == len(FLAGS)


@pytest.mark.parametrize("command", [["run"], ["record", "--", "true"], ["probe"]])
def test_a_shared_flag_sets_the_same_config_in_every_command(command: list[str]) -> None:
    parser, _ = build_parser()
    given = ["--source", "sim", "--fields", "gpu_temp,fast", "--duration", "2s"]
    args = parser.parse_args([command[0], *given, *command[1:]])
    config = options(args).config if command[0] == "record" else config_from_args(args)
    assert (config.source, config.fields, config.duration_s) == ("sim", ("gpu_temp", "fast"), 2.0)


def test_a_flag_mistake_names_the_flag_in_every_command() -> None:
    parser, _ = build_parser()
    for argv in (["run", "--window", "1"], ["record", "--window", "1", "--", "true"]):
        with pytest.raises(ConfigError, match=r"^--window: '1' has no unit"):
            config_from_args(parser.parse_args(argv))


def test_record_gpus_selects_gpus_rather_than_counting_simulated_ones() -> None:
    parser, _ = build_parser()
    opts = options(parser.parse_args(["record", "--source", "sim", "--gpus", "0,2", "--", "x"]))
    assert opts.gpus == ("0", "2")
    assert opts.config.sim_gpus == 3
    assert opts.config.listen is None  # record serves no /metrics
