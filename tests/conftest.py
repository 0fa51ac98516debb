import pytest
import torch

# Worst relative errors against the FP64 oracle, per suite, printed at the end of the run.
WORST: dict[str, tuple[float, str]] = {}


def record_error(suite: str, err: float, case: str) -> None:
    if err > WORST.get(suite, (-1.0, ""))[0]:
        WORST[suite] = (err, case)


@pytest.fixture
def fp8_aware_allclose(monkeypatch):
    """opcheck's schema check compares inputs before and after the call with
    torch.allclose, which has no float8 kernels: compare float8 tensors bit for bit."""
    allclose = torch.allclose

    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)

    def patched(a, b, *args, **kw):
        if a.dtype in fp8 or b.dtype in fp8:
            return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kw)

    monkeypatch.setattr(torch, "allclose", patched)


@pytest.fixture
def record():
    return record_error


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if WORST:
        terminalreporter.section("worst relative error vs the FP64 oracle")
        for suite, (err, case) in sorted(WORST.items()):
            terminalreporter.write_line(f"{suite:<28} {err:.3e}  ({case})")
