"""The XID code -> description table behind ``err_msg`` (dcgm-exporter's labels)."""

from __future__ import annotations

import re

from hfsampler.export import xid_messages as X


def test_every_code_nvidia_names_up_to_172_and_unknown_beyond() -> None:
    assert sorted(X.MESSAGES) == list(range(173))
    assert X.labels(0) == (("err_code", "0"), ("err_msg", "No Error"))
    assert X.labels(79) == (("err_code", "79"), ("err_msg", "GPU has fallen off the bus"))
    assert X.message(48) == "Double Bit ECC Error"
    assert X.message(95) == "Uncontained ECC error"
    assert X.message(70) == "CE3: Unknown Error"
    assert X.message(85) == "CE9: Unknown Error"
    assert X.message(98) == "NVDEC7 Error"
    assert X.message(105) == "NVJPG7 Error"
    assert X.message(135) == "Robust Channel CE19 Error"
    assert X.message(173) == X.message(-1) == "Unknown Error"


def test_messages_are_safe_label_values() -> None:
    # printable ASCII, nothing the text exposition would escape, within every receiver's limit
    for code, text in X.MESSAGES.items():
        assert re.fullmatch(r"[ -~]+", text), code
        assert '"' not in text, code
        assert "\\" not in text, code
        assert len(text) <= X.MAX_MESSAGE_CHARS, code
        assert text == text.strip(), code
