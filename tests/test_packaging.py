"""The wheel is pure Python and carries the CUDA sources as package data.

``pip install cupyrope`` must need no compiler and no CUDA toolkit: the wheel holds the Python
package plus ``kernels_cu/*.cu`` / ``*.cuh``, mapped to ``cupyrope/kernels_cu/`` by the
package-dir table in pyproject.toml, where ``importlib.resources`` finds them at run time.

The sdist and the wheel are built once per module from a copy of the checkout (an in-tree build
would leave ``build/`` and ``*.egg-info`` in the repository) by ``python -m build`` with the
setuptools already installed, so the test needs no network. ``build`` makes the wheel from the
unpacked sdist, so a file the sdist forgets is missing from the wheel too. It takes a few seconds;
the build is capped at 60 s.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 60

# The wheel is built from the top-level files (pyproject.toml, README.md, a licence ...) and the two
# package folders; the rest of the checkout (benchmarks, scratch data, virtual environments) has no
# part in the wheel and could be large. Caches and earlier build outputs are left out so that
# nothing stale leaks into the wheel.
_PACKAGE_FOLDERS = ("cupyrope", "kernels_cu")
_NOT_COPIED = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "dist", "*.egg-info")


def _copy_build_inputs(destination: Path) -> None:
    destination.mkdir(parents=True)
    for path in REPO.iterdir():
        if path.is_file():
            shutil.copy2(path, destination / path.name)
    for folder in _PACKAGE_FOLDERS:
        shutil.copytree(REPO / folder, destination / folder, ignore=_NOT_COPIED)


class BuiltWheel:
    def __init__(self, path: Path):
        self.path = path
        with zipfile.ZipFile(path) as archive:
            self.names = set(archive.namelist())
            self._archive_bytes = {name: archive.read(name) for name in self.names}

    def read(self, name: str) -> bytes:
        return self._archive_bytes[name]

    def dist_info_file(self, filename: str) -> str:
        (name,) = [n for n in self.names if n.endswith(f".dist-info/{filename}")]
        return self.read(name).decode()


@pytest.fixture(scope="module")
def distributions(tmp_path_factory) -> Path:
    """The folder holding the sdist and the wheel built from it."""
    # --no-isolation: use the installed setuptools instead of fetching one from an index; build
    # still checks it against pyproject.toml's build requirements and names what is missing.
    pytest.importorskip("build", reason="building the sdist and wheel needs the build package")
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools")
    source = tmp_path_factory.mktemp("source") / "cupyrope"
    _copy_build_inputs(source)
    out = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return out


@pytest.fixture(scope="module")
def wheel(distributions) -> BuiltWheel:
    (path,) = distributions.glob("cupyrope-*.whl")
    return BuiltWheel(path)


def test_wheel_is_pure_python(wheel):
    assert wheel.path.name == "cupyrope-0.1.0-py3-none-any.whl"
    metadata = email.parser.Parser().parsestr(wheel.dist_info_file("WHEEL"))
    assert metadata["Root-Is-Purelib"] == "true"
    assert metadata.get_all("Tag") == ["py3-none-any"]
    binaries = sorted(n for n in wheel.names if n.endswith((".so", ".pyd", ".dll", ".dylib")))
    assert not binaries, f"a pure-Python wheel holds compiled files: {binaries}"


def test_wheel_holds_only_the_cupyrope_package(wheel):
    # tests/, benchmarks/ or a top-level kernels_cu/ must not be installed into site-packages.
    stray = sorted(
        n for n in wheel.names
        if not n.startswith("cupyrope/") and not n.startswith("cupyrope-0.1.0.dist-info/")
    )
    assert not stray, f"files outside cupyrope/ in the wheel: {stray}"


def test_wheel_ships_every_python_module(wheel):
    modules = sorted(p.relative_to(REPO / "cupyrope").as_posix()
                     for p in (REPO / "cupyrope").rglob("*.py") if "__pycache__" not in p.parts)
    assert "__init__.py" in modules and "compat/__init__.py" in modules
    missing = [m for m in modules if f"cupyrope/{m}" not in wheel.names]
    assert not missing, f"cupyrope modules missing from the wheel: {missing}"


def test_wheel_ships_the_licence_and_type_information(wheel):
    assert "cupyrope/py.typed" in wheel.names
    licence = [n for n in wheel.names if n.endswith("LICENSE") and ".dist-info/" in n]
    assert licence and wheel.read(licence[0]) == (REPO / "LICENSE").read_bytes()
    assert b"Copyright 2026 the cupyrope authors" in wheel.read(licence[0])
    metadata = email.parser.Parser().parsestr(wheel.dist_info_file("METADATA"))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any("github.com/cupyrope/cupyrope" in url for url in metadata.get_all("Project-URL"))


def test_sdist_ships_the_licence_and_the_sources(distributions):
    (path,) = distributions.glob("cupyrope-*.tar.gz")
    with tarfile.open(path) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    expected = {"LICENSE", "README.md", "pyproject.toml", "cupyrope/py.typed", "kernels_cu/rope.cu"}
    assert expected <= names, f"missing from the sdist: {sorted(expected - names)}"


def test_wheel_ships_every_kernel_source(wheel):
    sources = sorted(
        p for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh", ".py")
    )
    names = [p.name for p in sources]
    assert "rope.cu" in names and "__init__.py" in names
    assert any(name.endswith(".cuh") for name in names)
    for path in sources:
        member = f"cupyrope/kernels_cu/{path.name}"
        assert member in wheel.names, f"{member} is missing from the wheel"
        assert wheel.read(member) == path.read_bytes(), f"{member} differs from the checkout"


def test_metadata_lists_the_extras(wheel):
    metadata = email.parser.Parser().parsestr(wheel.dist_info_file("METADATA"))
    assert metadata["Name"] == "cupyrope"
    assert metadata["Version"] == "0.1.0"
    assert metadata["Requires-Python"] == ">=3.10"
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"cuda12", "cuda13", "test", "bench"} <= extras, f"extras are {sorted(extras)}"

    requirements = metadata.get_all("Requires-Dist")
    unconditional = [r for r in requirements if "extra ==" not in r]
    # Installing without an extra must not pull CuPy (and its CUDA wheels) in; ml_dtypes (bfloat16
    # for NumPy) is small and the bf16 demo needs it on the NumPy path.
    assert [r.split(">")[0].split("=")[0].strip() for r in unconditional] == ["numpy", "ml_dtypes"]

    def extra(name: str) -> str:
        return " ".join(r for r in requirements if f'extra == "{name}"' in r)

    # Each CUDA extra brings CuPy and a pip NVRTC of the same major version: no toolkit needed.
    assert "cupy-cuda13x" in extra("cuda13") and "nvidia-cuda-nvrtc" in extra("cuda13")
    assert "cupy-cuda12x" in extra("cuda12") and "nvidia-cuda-nvrtc-cu12" in extra("cuda12")
    # The README's install line on a fresh machine (cuda13, test, interop) brings everything the
    # suite imports: a fresh venv's setuptools cannot build this wheel, and without mpmath, torch
    # or JAX whole files skip.
    for tool in ("pytest", "pytest-xdist", "hypothesis", "mpmath", "build", "setuptools", "wheel",
                 "transformers==5.23.0"):
        assert re.search(rf"(^| ){re.escape(tool)}[ ;=<>]", extra("test")), f"test extra lacks {tool}"
    assert "torch==2.13.0" in extra("interop") and "jax[cpu]==0.10.2" in extra("interop")
    for tool in ("pytest-benchmark", "matplotlib", "tqdm", "tabulate"):
        assert tool in extra("bench"), f"bench extra lacks {tool}"


def test_a_missing_ml_dtypes_is_named_at_import():
    # ml_dtypes is a base dependency (bfloat16 for NumPy): an install without it must say so in
    # one line at import, not fail later inside a call.
    probe = "import sys; sys.modules['ml_dtypes'] = None; import cupyrope"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=BUILD_TIMEOUT_S, cwd=REPO)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == ("ImportError: bfloat16 arrays need the ml_dtypes package, a dependency of "
                         "cupyrope that is missing here: pip install ml_dtypes (or reinstall cupyrope)")


def test_installed_wheel_finds_its_kernel_sources(wheel, tmp_path):
    # Unpacked, a pure-Python wheel is an installed package. Import it in a fresh interpreter with
    # only that folder added to the path, so cupyrope resolves there (not to this checkout) and
    # kernel_source_dir() must find rope.cu through importlib.resources inside the package.
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel.path) as archive:
        archive.extractall(site)
    probe = (
        "import json, cupyrope, cupyrope.cuda.compiler as k\n"
        "print(json.dumps([cupyrope.__file__, str(k.kernel_source_dir()), k._read_sources()[0],\n"
        "                  cupyrope.__version__]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert result.returncode == 0, result.stderr
    package_file, source_dir, rope_cu, version = json.loads(result.stdout.splitlines()[-1])
    assert Path(package_file).is_relative_to(site), f"imported {package_file}, not the wheel's"
    assert Path(source_dir) == site / "cupyrope" / "kernels_cu"
    assert rope_cu == (REPO / "kernels_cu" / "rope.cu").read_text()
    # No pyproject.toml beside an installed package: the version comes from the wheel's metadata.
    assert version == "0.1.0"


def test_the_version_is_written_once():
    import cupyrope

    declared = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert declared and cupyrope.__version__ == declared.group(1)
    assert declared.group(1) not in (REPO / "cupyrope" / "__init__.py").read_text()


def _fresh_machine_commands(readme: str) -> list[str]:
    section = re.search(r"^## Two commands on a fresh machine\n(.*?)(?=^## )", readme, re.M | re.S)
    assert section, "the README has no 'Two commands on a fresh machine' section"
    block = re.search(r"^```[a-z]*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the fresh-machine section has no code block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_commands():
    """The README's fresh-machine block holds two complete commands (install and demo; install and
    tests), and CI runs the second as written, read from the README itself."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    demo, tests = _fresh_machine_commands(readme)
    assert re.fullmatch(r'python -m pip install -e "\.\[[a-z0-9,]+\]" && python -m cupyrope', demo), demo
    assert re.fullmatch(r'python -m pip install -e "\.\[[a-z0-9,]*test[a-z0-9,]*\]" && python -m pytest tests',
                        tests), tests
    assert "^## Two commands on a fresh machine" in ci, "CI does not read the README's block"
    assert 'eval "${readme_install}"' in ci
    assert "\npython -m pytest tests\n" in ci


def test_the_readme_installs_the_bench_extra_before_running_the_benchmarks():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    running = [block for block in blocks if "pytest benchmarks" in block]
    assert running, "the README does not say how to run the benchmarks"
    for block in running:
        assert re.search(r'pip install -e "\.\[[a-z0-9,]*bench[a-z0-9,]*\]"', block), block
