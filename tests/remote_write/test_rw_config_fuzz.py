"""Config fuzzing: any malformed YAML or value makes ``check-config`` exit 2 with one line naming
the key, never a traceback; secrets in the file never appear in what it prints."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hfsampler.cli.main import main

SECRET = "fuzz-Secret-4d2"
ENDPOINT_KEYS = [
    "url", "name", "remote_timeout", "headers", "queue_config", "flavor", "tenant", "basic_auth",
    "authorization", "bearer_token", "bearer_token_file", "tls_config", "proxy_url",
    "write_relabel_configs", "protobuf_message", "sigv4",
]  # fmt: skip
NESTED_KEYS = [
    "username", "password", "password_file", "type", "credentials", "credentials_file",
    "ca_file", "cert_file", "key_file", "server_name", "insecure_skip_verify", "capacity",
    "max_shards", "min_shards", "max_samples_per_send", "batch_send_deadline", "min_backoff",
    "max_backoff", "retry_on_http_429", "max_disk_bytes", "source_labels", "separator",
    "target_label", "regex", "replacement", "action", "X-Scope-OrgID", "Authorization",
]  # fmt: skip
TOP_KEYS = ["source", "window", "listen", "queue_dir", "external_labels", "remote_write", "gpus"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "http://127.0.0.1:9/api/v1/write",
            "https://x/",
            "mimir",
            "thanos",
            "keep",
            "labelmap",
            "(",
            ".*_max",
            "$1",
            "1s",
            "0",
            "-5ms",
            "512MiB",
            "/nonexistent/x",
            "a\x00b",
            "prometheus",
            "victoriametrics",
            "Bearer",
            "Basic",
            "[",
            "(?=x)",
            "\\1",
        ]
    ),
)
values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(NESTED_KEYS) | st.text(max_size=5), inner, max_size=4),
    ),
    max_leaves=12,
)
# Secrets go only where secrets belong; whatever else is wrong, they must never be echoed.
secret_blocks = st.sampled_from(
    [
        {},
        {"basic_auth": {"username": "u", "password": SECRET}},
        {"basic_auth": {"username": "u", "password": SECRET, "password_file": "/x"}},
        {"basic_auth": {"password": SECRET}},
        {"authorization": {"credentials": SECRET}},
        {"authorization": {"type": "Not Valid", "credentials": SECRET}},
        {"bearer_token": SECRET},
        {"headers": {"X-Token": SECRET}},
        {"headers": {"Authorization": SECRET}, "bearer_token": SECRET},
        {"url": f"http://u:{SECRET}@127.0.0.1:9/w?token={SECRET}"},
        {"proxy_url": f"http://u:{SECRET}@proxy:3128"},
    ]
)
endpoints = st.builds(
    lambda raw, secrets: {**raw, **secrets},
    st.dictionaries(st.sampled_from(ENDPOINT_KEYS), values, max_size=6),
    secret_blocks,
)
documents = st.builds(
    lambda top, rw: {**top, **rw},
    st.dictionaries(st.sampled_from(TOP_KEYS), values, max_size=3),
    st.one_of(
        st.just({}),
        st.builds(lambda eps: {"remote_write": eps}, st.lists(endpoints, max_size=3)),
    ),
)


def check(text: str) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["check-config", str(path)])
    return rc, out.getvalue() + err.getvalue()


def assert_clean(rc: int, output: str, secrets_placed: bool = True) -> None:
    assert rc in (0, 2), (rc, output)
    assert "Traceback" not in output
    if secrets_placed:  # the secret sits only under secret keys: it must never be shown
        assert SECRET not in output
    if rc == 2:
        lines = output.strip().splitlines()
        assert len(lines) == 1, output
        assert lines[0].startswith("hfsampler: error: "), output


@settings(derandomize=bool(os.environ.get("CI")))
@given(documents)
def test_structured_configs_exit_0_or_2(doc: dict[str, Any]) -> None:
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    assert_clean(*check(text))


@settings(derandomize=bool(os.environ.get("CI")))
@given(st.text(max_size=200))
def test_arbitrary_text_exits_0_or_2(text: str) -> None:
    assert_clean(*check(text))


@settings(derandomize=bool(os.environ.get("CI")))
@given(st.lists(st.sampled_from(["remote_write:\n", "  - url: ", "http://a/\n", "    ",
                                 "basic_auth: {password: " + SECRET + "}\n", "tenant: [\n",
                                 "flavor: mimir\n", "tls_config:\n", "      ca_file: ''\n",
                                 "write_relabel_configs: [{action: replace}]\n", "\t", ": ",
                                 "queue_dir: ", "'''", "- ", "{", "}"]),
                max_size=12))  # fmt: skip
def test_yaml_fragments_exit_0_or_2(parts: list[str]) -> None:
    # Fragments can quote the secret into any value (a path, a name): check only exit and shape.
    assert_clean(*check("".join(parts)), secrets_placed=False)
