"""What `pip install .` ships: a wheel built from the tree holds every module and every CUDA template the JIT renders
(an editable install reads them from the tree, so only a built wheel shows a missing one)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from substation.shipped import shipped

ROOT = Path(__file__).parents[1]


def test_the_wheel_ships_every_template_and_module(tmp_path):
    # A copy without build outputs: setuptools would otherwise reuse an earlier build's files.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", ".*", "__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("substation-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = {f"substation/kernels/templates/{p.name}" for p in (ROOT / "kernels" / "templates").glob("*.j2")}
    assert templates and templates <= names, sorted(templates - names)
    modules = {f"substation/{p.stem if p.parent.name == 'substation' else p.parent.name + '/' + p.stem}.py"
               for folder in ("substation", "kernels", "tc_profiling", "config_selection")
               for p in (ROOT / folder).glob("*.py")}
    assert modules <= names, sorted(modules - names)
    configurations = {f"substation/shipped/{s.path.name}" for s in shipped()}  # what `layouts="shipped"` chooses from
    assert configurations and configurations <= names, sorted(configurations - names)
    # Unpacked as pip installs it, the package finds them there, not in a checkout's layouts/.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = "from substation.shipped import shipped; print(*sorted({str(s.path.parent) for s in shipped()}))"
    found = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                           env=os.environ | {"PYTHONPATH": str(site)})
    assert found.stdout.split() == [str(site / "substation" / "shipped")], found.stderr
