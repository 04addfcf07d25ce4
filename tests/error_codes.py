"""The kernels' error codes (gemm_ar::ErrorCode), read from the protocol header itself, so the tests that look at an
error record never keep a second list of the numbers."""
import pathlib
import re

_HEADER = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "include" / "gemm_ar" / "kernel_args.hpp"


def _parse():
    text = _HEADER.read_text()
    body = re.search(r"enum\s+(?:class\s+)?ErrorCode\b[^{]*\{(.*?)\};", text, re.S)
    if body is None:
        raise RuntimeError(f"no `enum ErrorCode` in {_HEADER}")
    codes = {name: int(value) for name, value in re.findall(r"\b(kErr\w+)\s*=\s*(\d+)", body.group(1))}
    if not codes:
        raise RuntimeError(f"`enum ErrorCode` in {_HEADER} has no `kErrX = n` entries")
    return codes


CODES = _parse()


def code(name: str) -> int:
    """code("kErrTimeoutReduce") -> its number."""
    return CODES[name]
