"""The registry of run-time settings (csrc/host/common/settings.h, through _C._settings()): every TORCH_GEMM_AR_*
variable the library reads is in it, and docs/usage.md's configuration table documents exactly those."""
import re
from pathlib import Path

from torch_gemm_ar import _C

ROOT = Path(__file__).resolve().parents[1]
# Build-time variables (setup.py, build_npu.py) and macros setup.py defines: not run-time settings.
NOT_SETTINGS = {"TORCH_GEMM_AR_VERSION", "TORCH_GEMM_AR_SOURCE_HASH", "TORCH_GEMM_AR_TEST_HOOKS"}


def registered():
    return {s["variable"] for s in _C._settings()}


def names_in(paths):
    found = set()
    for path in paths:
        found |= set(re.findall(r"TORCH_GEMM_AR_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    return found - NOT_SETTINGS


def test_every_variable_the_library_reads_is_registered():
    sources = [p for p in (ROOT / "csrc" / "host").rglob("*") if p.suffix in (".cpp", ".h")]
    sources += list((ROOT / "torch_gemm_ar").rglob("*.py"))
    assert sources
    unregistered = names_in(sources) - registered()
    assert not unregistered, f"read but not in GEMM_AR_SETTING_LIST (common/settings.h): {sorted(unregistered)}"


def test_every_entry_is_complete_and_unique():
    settings = _C._settings()
    assert len({s["variable"] for s in settings}) == len(settings)
    for s in settings:
        assert s["variable"].startswith("TORCH_GEMM_AR_") and s["default"] and s["read"] and s["meaning"], s


def test_the_docs_table_documents_exactly_the_registry():
    text = (ROOT / "docs" / "usage.md").read_text()
    documented = set()
    for line in text.splitlines():
        if line.startswith("| `TORCH_GEMM_AR_"):
            documented |= set(re.findall(r"`(TORCH_GEMM_AR_[A-Z0-9_]+)`", line.split("|")[1]))
    assert documented == registered(), (f"in docs/usage.md only: {sorted(documented - registered())}; "
                                        f"registered only: {sorted(registered() - documented)}")
