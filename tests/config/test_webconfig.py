"""The web configuration file (exporter-toolkit's format): what it accepts, and each mistake
refused at load in one line that names the key, never quoting a password hash."""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from certs import Pki, make_pki

from hfsampler.cli.main import main
from hfsampler.config.loader import from_mapping
from hfsampler.config.webconfig import load_web_config
from hfsampler.errors import ConfigError

HASH = bcrypt.hashpw(b"Web-Pa55word-7f3a", bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def write(path: Path, data: Any) -> str:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)  # JSON is YAML
    return str(path)


def tls_block(pki: Pki, **extra: object) -> dict[str, object]:
    return {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), **extra}


def test_a_full_file_is_read_with_relative_names_taken_from_its_directory(
    tmp_path: Path, pki: Pki
) -> None:
    (tmp_path / "tls").mkdir()
    for src, name in ((pki.server_cert, "s.pem"), (pki.server_key, "s.key"), (pki.ca_file, "ca")):
        (tmp_path / "tls" / name).write_bytes(src.read_bytes())
    path = write(tmp_path / "web.yml", {
        "tls_server_config": {"cert_file": "tls/s.pem", "key_file": "tls/s.key",
                              "client_ca_file": "tls/ca",
                              "client_auth_type": "RequireAndVerifyClientCert",
                              "min_version": "TLS13", "prefer_server_cipher_suites": False},
        "basic_auth_users": {"prometheus": HASH},
        "http_server_config": {"http2": False, "headers": {
            "X-Frame-Options": "deny", "Strict-Transport-Security": "max-age=31536000",
            "X-XSS-Protection": ""}},
    })  # fmt: skip
    web = load_web_config(path)
    assert web.tls is not None
    assert web.tls.cert_file == str(tmp_path / "tls" / "s.pem")
    assert web.tls.client_ca_file == str(tmp_path / "tls" / "ca")
    assert (web.tls.min_version, web.tls.max_version) == ("TLS13", "TLS13")
    assert web.users == {"prometheus": HASH.encode()}
    # a blank header is unset, as the toolkit does
    assert web.headers == {
        "X-Frame-Options": "deny",
        "Strict-Transport-Security": "max-age=31536000",
    }
    assert HASH not in repr(web)
    assert HASH not in web.describe()
    assert web.files() == (path, web.tls.cert_file, web.tls.key_file, web.tls.client_ca_file)


def test_an_empty_file_or_an_empty_tls_block_serves_plain_http(tmp_path: Path) -> None:
    assert load_web_config(write(tmp_path / "a.yml", "")).tls is None
    web = load_web_config(
        write(tmp_path / "b.yml", {"tls_server_config": {"min_version": "TLS13"}})
    )
    assert web.tls is None
    assert not web.users
    assert not web.headers


def test_each_client_auth_type_maps_to_a_verify_mode_no_weaker_than_go(
    tmp_path: Path, pki: Pki
) -> None:
    from hfsampler.config.webconfig import server_context

    expected = {
        "NoClientCert": ssl.CERT_NONE,
        "RequestClientCert": ssl.CERT_OPTIONAL,
        "RequireAnyClientCert": ssl.CERT_REQUIRED,
        "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
        "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    }
    for kind, mode in expected.items():
        ca = {"client_ca_file": str(pki.ca_file)} if kind != "NoClientCert" else {}
        tls = load_web_config(write(tmp_path / f"{kind}.yml", {
            "tls_server_config": tls_block(pki, client_auth_type=kind, **ca)})).tls  # fmt: skip
        assert tls is not None
        assert server_context(tls).verify_mode == mode, kind


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("typo at the top", {"basic_auth_user": {"a": HASH}},
     "web_config_file: basic_auth_user: unknown key (did you mean 'basic_auth_users'?)"),
    ("unknown tls key", {"tls_server_config": {"cert_fil": "x"}},
     "web_config_file: tls_server_config.cert_fil: unknown key (did you mean 'cert_file'?)"),
    ("unsupported key", {"rate_limit": {"interval": "1s", "burst": 1}},
     "web_config_file: rate_limit: is not supported"),
    ("inline cert", {"tls_server_config": {"cert": "-----BEGIN"}},
     "web_config_file: tls_server_config.cert: is not supported (give the certificate as a file"),
    ("ciphers", {"tls_server_config": {"cipher_suites": ["TLS_AES_128_GCM_SHA256"]}},
     "web_config_file: tls_server_config.cipher_suites: is not supported"),
    ("no key", {"tls_server_config": {"cert_file": "{cert}"}},
     "web_config_file: tls_server_config.key_file: is missing"),
    ("a policy alone", {"tls_server_config": {"client_auth_type": "RequireAndVerifyClientCert"}},
     "web_config_file: tls_server_config.cert_file: is missing"),
    ("bad policy", {"tls_server_config": {"cert_file": "{cert}", "key_file": "{key}",
                                          "client_auth_type": "VerifyAlways"}},
     "web_config_file: tls_server_config.client_auth_type: unknown value 'VerifyAlways' (one of "
     "NoClientCert, RequestClientCert"),
    ("bad version", {"tls_server_config": {"cert_file": "{cert}", "key_file": "{key}",
                                           "min_version": "TLS1.2"}},
     "web_config_file: tls_server_config.min_version: unknown value 'TLS1.2' (one of TLS10"),
    ("versions crossed", {"tls_server_config": {"cert_file": "{cert}", "key_file": "{key}",
                                                "min_version": "TLS13", "max_version": "TLS12"}},
     "web_config_file: tls_server_config.min_version: TLS13 is above max_version TLS12"),
    ("a CA without a policy", {"tls_server_config": {"cert_file": "{cert}", "key_file": "{key}",
                                                     "client_ca_file": "{ca}"}},
     "web_config_file: tls_server_config.client_ca_file: is given but client_auth_type is "
     "NoClientCert (set client_auth_type: RequireAndVerifyClientCert)"),
    ("missing cert", {"tls_server_config": {"cert_file": "/nonexistent/s.pem",
                                            "key_file": "{key}"}},
     "web_config_file: tls_server_config.cert_file: cannot read /nonexistent/s.pem: No such file"),
    ("a key of another certificate", {"tls_server_config": {"cert_file": "{cert}",
                                                            "key_file": "{client_key}"}},
     "web_config_file: tls_server_config.cert_file: cannot load"),
    ("a CA that is no PEM", {"tls_server_config": {"cert_file": "{cert}", "key_file": "{key}",
                                                   "client_ca_file": "{web}",
                                                   "client_auth_type": "RequireAnyClientCert"}},
     "web_config_file: tls_server_config.client_ca_file: cannot load"),
    ("not a hash", {"basic_auth_users": {"alice": "{hash}x"}},
     "web_config_file: basic_auth_users.alice: is not a bcrypt hash (hash the password"),
    ("a clear password", {"basic_auth_users": {"alice": "Web-Pa55word-7f3a"}},
     "web_config_file: basic_auth_users.alice: is not a bcrypt hash"),
    # $2$, bcrypt's first version: Go checks it, Python's bcrypt cannot, so it would never match
    ("a $2$ hash", {"basic_auth_users": {"alice": "$2$" + HASH[4:]}},
     "web_config_file: basic_auth_users.alice: is not a bcrypt hash"),
    ("a header it reserves", {"http_server_config": {"headers": {"Server": "hfsampler"}}},
     "web_config_file: http_server_config.headers.Server: cannot be configured (the toolkit "
     "allows only Strict-Transport-Security, X-Content-Type-Options"),
    ("a header in another case", {"http_server_config": {"headers": {"x-frame-options": "deny"}}},
     "web_config_file: http_server_config.headers.x-frame-options: cannot be configured"),
    ("a header's value", {"http_server_config": {"headers": {"X-Frame-Options": "allow"}}},
     "web_config_file: http_server_config.headers.X-Frame-Options: unknown value 'allow' (one "
     "of deny, sameorigin)"),
    ("http2", {"http_server_config": {"http2": "yes"}},
     "web_config_file: http_server_config.http2: must be true or false"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_file_is_refused_naming_the_key(
    tmp_path: Path, pki: Pki, data: dict[str, Any], message: str
) -> None:
    web = tmp_path / "web.yml"
    names = {"cert": pki.server_cert, "key": pki.server_key, "ca": pki.ca_file,
             "client_key": pki.client_key, "web": web, "hash": HASH}  # fmt: skip
    text = json.dumps(data)
    for name, value in names.items():
        text = text.replace(f"{{{name}}}", str(value).replace("\\", "\\\\"))
    web.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_web_config(str(web))
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)
    assert HASH not in str(err.value)
    assert "Web-Pa55word" not in str(err.value)


def test_yaml_mistakes_name_the_key_and_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "web.yml", f"basic_auth_users:\n  alice: '{HASH}'\n  alice: '{HASH}'\n")
    with pytest.raises(ConfigError) as err:
        load_web_config(path)
    assert str(err.value) == (
        f"web_config_file: {path}: alice: given twice, at lines 2 and 3 (keep one)"
    )
    with pytest.raises(ConfigError, match=r"^web_config_file: cannot read /nonexistent/w.yml"):
        load_web_config("/nonexistent/w.yml")


def test_the_config_key_and_its_flag_check_the_file_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(tmp_path / "web.yml", {"basic_auth_users": {"alice": HASH[:-1]}})
    with pytest.raises(ConfigError, match=r"^web_config_file: basic_auth_users.alice: is not"):
        from_mapping({"web_config_file": bad})
    assert main(["run", "--source", "sim", "--web-config-file", bad, "--duration", "1s"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hfsampler: error: web_config_file: basic_auth_users.alice: is not a ")
    assert err.count("\n") == 1
    assert HASH[:-1] not in err
    good = write(tmp_path / "good.yml", {"basic_auth_users": {"alice": HASH}})
    config = write(tmp_path / "hfsampler.yml", {"web_config_file": good, "listen": ""})
    assert main(["check-config", config]) == 0
    out = capsys.readouterr().out
    assert f"web_config_file: {good}: no TLS; basic auth for 1 user(s)" in out
    assert "web_config_file is not used: listen is empty" in out
    assert HASH not in out


def test_the_example_in_the_deployment_docs_loads(tmp_path: Path, pki: Pki) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    section = page.split("## A protected /metrics", 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "tls").mkdir()
    for src, name in ((pki.server_cert, "tls.crt"), (pki.server_key, "tls.key"),
                      (pki.ca_file, "ca.crt")):  # fmt: skip
        (tmp_path / "tls" / name).write_bytes(src.read_bytes())
    web = load_web_config(write(tmp_path / "web.yml", example))
    assert web.describe() == (
        "TLS TLS12 to TLS13, client certificates RequireAndVerifyClientCert; basic auth for 1 "
        "user(s); headers Strict-Transport-Security"
    )
