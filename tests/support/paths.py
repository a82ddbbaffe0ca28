"""Where the repository and its test folder are, for tests that read or run their files."""

from pathlib import Path

TESTS_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_ROOT.parent
# The folders pyproject maps onto the installed package names.
SOURCE_FOLDERS = {
    "loomllm": "runtime",
    "loomllm.workers": "workers",
    "loomllm.protocols": "protocols",
    "loomllm.benchmarks": "benchmarks",
}
