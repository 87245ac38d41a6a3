"""No module of the runtime grows into a hub again (issue 44): every file under runtime/deepinfer/ stays
at most 600 lines. A file that needs more has more than one job; split it along its seams."""
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "runtime" / "deepinfer"
LIMIT = 600


def test_no_runtime_module_is_over_600_lines():
    # the reference backend is reached through a link (runtime/deepinfer/reference); rglob does not follow it
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, f"over {LIMIT} lines: {long}"
