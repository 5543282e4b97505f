"""Files a user names that are not what they should be: a FIFO, a device, a directory, a huge
file, a lone CR, a YAML mistake next to a password. Each is one line and exit 2, promptly, and
no message quotes what the file holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hfsampler.cli.main import main

SECRET = "Sup3r-Secret-PW"


def _odd(tmp_path: Path, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")  # no writer: reading it would block for ever
        return str(tmp_path / "fifo")
    if kind == "device":
        return "/dev/zero"  # endless: reading it would fill the memory
    if kind == "directory":
        return str(tmp_path)
    big = tmp_path / "big.csv"  # 2 MiB of valid rows: a log or a dump named by mistake
    big.write_text("DCGM_FI_DEV_GPU_TEMP, gauge, t\n" * 70_000)
    return str(big)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "huge"])
@pytest.mark.parametrize("option", ["--fields-csv", "config file", "web_config_file"])
def test_a_fifo_a_device_a_directory_or_a_huge_file_is_refused_without_reading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, option: str
) -> None:
    path = _odd(tmp_path, kind)
    if option == "web_config_file":
        config = tmp_path / "hfsampler.yml"
        config.write_text(f"web_config_file: {path}\n")
        argv = ["check-config", str(config)]
    elif option == "config file":
        argv = ["check-config", path]
    else:
        argv = ["check-config", option, path]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{path} is not a regular file" in err or f"{path} is over 1 MiB" in err, err


def test_a_lone_cr_is_data_as_gos_csv_reader_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Go splits records at LF only: this is one row of five fields, which dcgm-exporter refuses
    path = tmp_path / "counters.csv"
    path.write_bytes(b"DCGM_FI_DEV_GPU_TEMP, gauge, t\rDCGM_FI_DEV_POWER_USAGE, gauge, p\n")
    assert main(["check-config", "--fields-csv", str(path)]) == 2
    assert f"{path}, line 1: 5 fields" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value", [f"*{SECRET}", f"!{SECRET}", f"&{SECRET} [", f"*{SECRET} 'quoted'"]
)
def test_a_yaml_mistake_beside_a_password_does_not_quote_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    # a plaintext password that starts with *, ! or & is YAML syntax: PyYAML's message quotes it
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prom: {value}\n")
    config = tmp_path / "hfsampler.yml"
    config.write_text(
        "remote_write:\n  - url: http://127.0.0.1:9/api/v1/write\n"
        f"    basic_auth: {{username: u, password: {value}}}\n"
    )
    assert main(["check-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert " at line " in err, err
    assert SECRET not in err, err
    config.write_text(f"web_config_file: {web}\n")
    assert main(["check-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert " at line " in err, err
    assert SECRET not in err, err
