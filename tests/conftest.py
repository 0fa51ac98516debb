import pytest
import torch

# Worst relative errors against the FP64 oracle, per suite, printed at the end of the run.
WORST: dict[str, tuple[float, str]] = {}


def record_error(suite: str, err: float, case: str) -> None:
    if err > WORST.get(suite, (-1.0, ""))[0]:
        WORST[suite] = (err, case)


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
