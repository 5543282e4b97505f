"""The ``err_code`` and ``err_msg`` labels dcgm-exporter puts on DCGM_FI_DEV_XID_ERRORS.

dcgm-exporter's ``gpu_collector.go`` (``toMetric``) labels the last-XID series with the code
(``err_code``, the value as an integer) and NVIDIA's short description of it (``err_msg``):
"No Error" for 0 (no XID yet), "Unknown Error" for a code its table lacks. So the series changes
identity with each new code, and an alert can select codes (``err_code=~"48|79|95"``) and print
the text. hfsampler labels its series the same way (``export.metrics``): a new code is a new
series, and the previous one ends with a stale marker as any series that stops.

The descriptions are the names of NVIDIA's XID catalogue (docs.nvidia.com/deploy/xid-errors,
"Analyzing Xid Errors with the Xid Catalog"), for codes 0 to 172, so an ``err_msg`` selector
written against dcgm-exporter (4.8.4, ``internal/pkg/collector/xid_errors.go``, which takes the
same names) matches. They are plain ASCII without quotes or backslashes, at most
``MAX_MESSAGE_CHARS`` long: safe in the text exposition unescaped and far inside Mimir's
label-value limit (2048 bytes by default).
"""

from __future__ import annotations

from functools import lru_cache

ERR_CODE = "err_code"
ERR_MSG = "err_msg"
NO_ERROR = "No Error"
UNKNOWN = "Unknown Error"  # dcgm-exporter's text for a code outside its table
LABELS = (ERR_CODE, ERR_MSG)
MAX_MESSAGE_CHARS = 100

_PREEMPTIVE = (
    "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda"
)
# Each description and the codes NVIDIA gives it; numbered engine families follow below.
_NAMED: tuple[tuple[str, tuple[int, ...]], ...] = (
    (NO_ERROR, (0,)),
    ("Invalid or corrupted push buffer stream", (1, 2, 3, 4, 6, 11, 32)),
    ("Unused", (5, 10, 14, 15, 17, 23, 39, 40, 41, 49, 50, 51, 52, 53, 55)),
    ("Invalid or corrupted push buffer address", (7,)),
    ("GPU stopped processing", (8, 43, 46)),
    ("Driver error programming GPU", (9,)),
    ("Driver error handling GPU exception", (12,)),
    ("Graphics Engine Exception", (13,)),
    ("Display engine hung", (16,)),
    ("Bus mastering disabled in PCI Config Space", (18,)),
    ("Display Engine error", (19, 56)),
    ("Invalid or corrupted Mpeg push buffer", (20,)),
    ("Invalid or corrupted Motion Estimation push buffer", (21,)),
    ("Invalid or corrupted Video Processor push buffer", (22,)),
    ("GPU semaphore timeout", (24,)),
    ("Invalid or illegal push buffer stream", (25,)),
    ("Framebuffer timeout", (26,)),
    ("Video processor exception", (27, 28, 29, 34, 35, 36, 42, 47, 60, 65)),
    ("GPU semaphore access error", (30,)),
    ("GPU memory page fault", (31,)),
    ("Internal micro-controller error", (33, 59)),
    ("Driver firmware error", (37, 38)),
    ("Graphics Engine fault during context switch", (44,)),
    # the catalogue's own wording, kept whole so a selector on it matches
    (_PREEMPTIVE, (45,)),
    ("Double Bit ECC Error", (48,)),
    ("Auxiliary power is not connected to the GPU board", (54,)),
    ("Error programming video memory interface", (57,)),
    ("Unstable video memory interface detected", (58,)),
    ("Internal micro-controller breakpoint/warning", (61,)),
    ("Internal micro-controller halt", (62, 169)),
    ("ECC page retirement or row remapping recording event", (63,)),
    ("ECC page retirement or row remapper recording failure", (64,)),
    ("Illegal access by driver", (66, 67)),
    ("NVDEC0 Exception", (68,)),
    ("Graphics Engine class error", (69,)),
    ("NVENC2 Error", (73,)),
    ("NVLINK Error", (74,)),
    ("vGPU Start Error", (78,)),
    ("GPU has fallen off the bus", (79,)),
    ("Corrupted data sent to GPU", (80,)),
    ("VGA Subsystem Error", (81,)),
    ("NVJPG0 Error", (82,)),
    ("OFA Exception", (86,)),
    ("Reserved", (87, 90, 91, 108)),
    ("High single-bit ECC error rate", (92,)),
    ("Non-fatal violation of provisioned InfoROM wear limit", (93,)),
    ("Contained ECC error", (94,)),
    ("Uncontained ECC error", (95,)),
    ("SMBPBI Test Message", (106,)),
    ("SMBPBI Test Message Silent", (107,)),
    ("Context Switch Timeout Error", (109,)),
    ("Security Fault Error", (110,)),
    ("Display Bundle Error Event", (111,)),
    ("Display Supervisor Error", (112,)),
    ("DP Link Training Error", (113,)),
    ("Display Pipeline Underflow Error", (114,)),
    ("Display Core Channel Error", (115,)),
    ("Display Window Channel Error", (116,)),
    ("Display Cursor Channel Error", (117,)),
    ("Display Pixel Pipeline Error", (118,)),
    ("GSP RPC Timeout", (119,)),
    ("GSP Error", (120,)),
    ("C2C Link Error", (121,)),
    ("SPI PMU RPC Read Failure", (122,)),
    ("SPI PMU RPC Write Failure", (123,)),
    ("SPI PMU RPC Erase Failure", (124,)),
    ("Inforom FS Failure", (125,)),
    ("ALI Training Fail", (136,)),
    ("NVLink Privilege Error", (137,)),
    ("Robust Channel DLA Error", (138,)),
    ("Robust Channel OFA1 Error", (139,)),
    ("Unrecovered ECC Error", (140,)),
    ("Robust Channel Fast Path Error", (141,)),
    ("Robust Channel NVENVC3 Error", (142,)),  # sic: the spelling dcgm-exporter exports
    ("GPU Initialization Failure", (143,)),
    ("NVLINK: Saw Error", (144,)),
    ("NVLINK: RLW Error", (145,)),
    ("NVLINK: TLW Error", (146,)),
    ("NVLINK: TREX Error", (147,)),
    ("NVLINK: NVLPW_CTRL Error", (148,)),
    ("NVLINK: NETIR Error", (149,)),
    ("NVLINK: MSE Error", (150,)),
    ("Robust Channel Key rotation Error", (151,)),
    ("Robust Channel DLA SMMU Error", (152,)),
    ("Robust Channel DLA timeout Error", (153,)),
    ("GPU Recovery Action Changed", (154,)),
    ("NVLINK: SW Defined Error", (155,)),
    ("Resource Retirement Event", (156,)),
    ("Resource Retirement Failure", (157,)),
    ("GPU Fatal Timeout", (158,)),
    ("Robust Channel CHI Non-Data Error", (159,)),
    ("Channel Retirement Event", (160,)),
    ("Channel Retirement Failure", (161,)),
    ("Power Smoothing HW Circuitry Reengaged", (162,)),
    ("Power Smoothing HW Circuitry Disengaged", (163,)),
    ("Power Smoothing HW Circuitry Low Lifetime", (164,)),
    ("Power Smoothing HW Circuitry Lifetime Exhausted", (165,)),
    ("NVLINK Secure Crypto Error", (166,)),
    ("PCIE Fatal Timeout", (167,)),
    ("Reduced GPU Memory Capacity (Errors found in write protection region)", (168,)),
    ("NVLINK: Interrupt seen in CC mode", (170,)),
    ("Uncorrectable DRAM Error", (171,)),
    ("Uncorrectable SRAM Error", (172,)),
)

# Numbered engines: copy engines 3-9 ("CE3: Unknown Error"), 10-19 ("Robust Channel CE10
# Error"), video decoders 1-7 and JPEG engines 1-7, in the catalogue's code order.
_COPY_ENGINES = dict(zip((70, 71, 72, 75, 76, 77, 85), range(3, 10), strict=True))
_DECODERS = dict(zip((83, 84, 88, 89, 96, 97, 98), range(1, 8), strict=True))


def _table() -> dict[int, str]:
    table = {code: text for text, codes in _NAMED for code in codes}
    table |= {code: f"CE{n}: Unknown Error" for code, n in _COPY_ENGINES.items()}
    table |= {code: f"NVDEC{n} Error" for code, n in _DECODERS.items()}
    table |= {99 + k: f"NVJPG{k + 1} Error" for k in range(7)}
    table |= {126 + k: f"Robust Channel CE{10 + k} Error" for k in range(10)}
    return table


MESSAGES: dict[int, str] = _table()


def message(code: int) -> str:
    """NVIDIA's short description of XID ``code`` ("Unknown Error" for one it has none for)."""
    return MESSAGES.get(code, UNKNOWN)


@lru_cache(maxsize=256)  # a few codes in practice; bounded against a driver gone wrong
def labels(code: int) -> tuple[tuple[str, str], tuple[str, str]]:
    """The two labels of a DCGM_FI_DEV_XID_ERRORS series whose value is ``code``."""
    return (ERR_CODE, str(code)), (ERR_MSG, message(code))
