"""The installed package: one top-level name, loomllm, that stays light to import; the
daemon's and the workers' modules load none of the user's side."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.paths import REPO_ROOT, SOURCE_FOLDERS

import loomllm

OLD_TOP_LEVEL = ("runtime", "workers", "protocols", "benchmarks")


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter (outside the repository) has loaded after `code`."""
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-P", "-c", probe], cwd="/", capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def source_modules() -> set[str]:
    """Every module file of the source tree, as a path inside the installed wheel."""
    found = set()
    for name, folder in SOURCE_FOLDERS.items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            inside = path.relative_to(REPO_ROOT / folder).as_posix()
            found.add(f"{name.replace('.', '/')}/{inside}")
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # A copy of the sources: a build in the checkout would reuse the files its build/ holds.
    source = out / "source"
    leave_out = shutil.ignore_patterns("build", "*.egg-info", ".*", "__pycache__", "tests")
    shutil.copytree(REPO_ROOT, source, ignore=leave_out)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("loomllm-*.whl")
    return built


def test_the_wheel_holds_one_top_level_package_with_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"loomllm"}
    assert {name for name in names if name.endswith(".py")} == source_modules()
    assert not [name for name in names if "/tests/" in name or name.startswith("tests/")]
    # The C++ kernels the workers build, from the folders they live in.
    from loomllm.workers.kernels import cpu_native

    code = (*cpu_native.SOURCES, *cpu_native.HEADERS)
    assert {f"loomllm/workers/{path.parent.name}/{path.name}" for path in code} <= set(names)


def test_installed_from_the_wheel_nothing_old_is_importable(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    probe = (
        f"import importlib.util, json, sys; sys.path.insert(0, {str(site)!r}); import loomllm; "
        f"print(json.dumps([loomllm.__file__, "
        f"[importlib.util.find_spec(m) is not None for m in {list(OLD_TOP_LEVEL)!r}]]))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    where, found = json.loads(out.stdout)
    assert where.startswith(str(site)), where
    assert found == [False] * len(OLD_TOP_LEVEL), dict(zip(OLD_TOP_LEVEL, found, strict=True))


def test_import_loomllm_loads_no_torch_transformers_or_server():
    loaded = loaded_after("import loomllm\nfrom loomllm import Engine, LLM, SamplingParams")
    heavy = {"torch", "transformers", "starlette", "hypercorn", "loomllm.workers", "loomllm.server"}
    assert not heavy & loaded


def test_the_daemon_loads_no_torch_and_the_worker_no_user_side():
    daemon = loaded_after("import loomllm.workers.manager.daemon, loomllm.workers.manager.cli")
    assert "torch" not in daemon
    worker = loaded_after("import loomllm.workers.worker.main, loomllm.workers.worker.zygote")
    user_side = {
        m
        for m in worker
        if m.startswith("loomllm.") and not m.startswith(("loomllm.workers", "loomllm.protocols"))
    }
    assert not user_side


def test_public_names_load_on_first_use():
    assert set(loomllm.__all__) <= set(dir(loomllm))
    for name in loomllm.__all__:
        assert getattr(loomllm, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        loomllm.Nope  # noqa: B018
